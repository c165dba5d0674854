"""The SIPREC (RFC 7865/7866) recording-server door: an SBC or PBX records a call by sending it here as a
SIP session (`--siprec-port`, UDP and TCP) whose SDP offers each leg as a sendonly RTP stream and whose
rs-metadata names the participants. One module, one job: `sip` (messages), `sdp` (offer/answer),
`metadata` (participants per stream label), `rtp` (the receiver thread), `door` (dialogs -> streams)."""
