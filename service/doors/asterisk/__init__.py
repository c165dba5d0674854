"""Asterisk's media doors: AudioSocket over TCP (audiosocket.py) and chan_websocket (websocket.py)."""
