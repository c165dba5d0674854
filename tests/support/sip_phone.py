"""A SIP phone for the telephony tests: PJSUA2 (pjproject's own SIP and media stack, PyPI `pjsua2-python`)
calls a SIP URI, says a WAV file into the call once its media is up, and hangs up (BYE) when the file has
been played. Run as a process of its own (`python -m tests.support.sip_phone URI WAV`): pjsua2 keeps one
library instance per process and wants its calls made from the thread that polls it.

Exit status: 0 the call was answered and hung up by us; 1 it was refused or ended by the other side first."""

from __future__ import annotations

import argparse
import sys
import time

import pjsua2 as pj
import soundfile as sf


class Call(pj.Call):  # type: ignore[misc]  # pjsua2 is SWIG-generated, without type information
    def __init__(self, account: pj.Account, wav: str) -> None:
        super().__init__(account)
        self.wav = wav
        self.player: pj.AudioMediaPlayer | None = None
        self.media_up_at: float | None = None
        self.disconnected = False
        self.status = 0

    def onCallState(self, prm: pj.OnCallStateParam) -> None:
        info = self.getInfo()
        self.status = info.lastStatusCode
        if info.state == pj.PJSIP_INV_STATE_DISCONNECTED:
            self.disconnected = True

    def onCallMediaState(self, prm: pj.OnCallMediaStateParam) -> None:
        info = self.getInfo()  # held: its media vector lives only as long as it does
        for index, media in enumerate(info.media):
            active = media.type == pj.PJMEDIA_TYPE_AUDIO and media.status == pj.PJSUA_CALL_MEDIA_ACTIVE
            if active and self.player is None:
                self.player = pj.AudioMediaPlayer()
                self.player.createPlayer(self.wav, pj.PJMEDIA_FILE_NO_LOOP)
                self.player.startTransmit(self.getAudioMedia(index))
                self.media_up_at = time.monotonic()


def call(uri: str, wav: str, timeout_s: float) -> int:
    endpoint = pj.Endpoint()
    endpoint.libCreate()
    config = pj.EpConfig()
    config.uaConfig.threadCnt = 0  # every callback on this thread, from libHandleEvents
    config.uaConfig.mainThreadOnly = True
    config.logConfig.level = 1
    config.logConfig.consoleLevel = 1
    endpoint.libInit(config)
    transport = pj.TransportConfig()
    transport.port = 0
    endpoint.transportCreate(pj.PJSIP_TRANSPORT_UDP, transport)
    endpoint.libStart()
    endpoint.audDevManager().setNullDev()  # no sound card: the conference bridge runs on its own clock
    account_config = pj.AccountConfig()
    account_config.idUri = "sip:caller@127.0.0.1"
    account = pj.Account()
    account.create(account_config)
    length_s = sf.info(wav).duration
    phone = Call(account, wav)
    phone.makeCall(uri, pj.CallOpParam(True))
    deadline = time.monotonic() + timeout_s
    hung_up = False
    try:
        while not phone.disconnected and time.monotonic() < deadline:
            endpoint.libHandleEvents(20)
            said = phone.media_up_at is not None and time.monotonic() - phone.media_up_at > length_s + 0.5
            if said and not hung_up:
                hung_up = True
                phone.hangup(pj.CallOpParam(True))
        for _ in range(25):  # let the BYE's answer arrive
            endpoint.libHandleEvents(20)
        status = phone.status
    finally:
        # the call and account wrappers go before the library: their destructors call into it
        del phone, account
        endpoint.libDestroy()
    if not hung_up:
        print(f"the call ended before the file was said (SIP status {status})", file=sys.stderr)
        return 1
    return 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("uri", help="whom to call, e.g. sip:audiosocket@127.0.0.1:5070")
    parser.add_argument("wav", help="what to say: a WAV file (8 or 16 kHz, 16-bit mono)")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds the whole call may take")
    args = parser.parse_args()
    sys.exit(call(args.uri, args.wav, args.timeout))


if __name__ == "__main__":
    main()
