"""The NVIDIA Riva ASR door: `nvidia.riva.asr.RivaSpeechRecognition` on the gRPC port, beside asr.v1.

One translation layer, over the generated messages and servicer base of the `nvidia-riva-client`
package (never a copy of its proto): a Riva RecognitionConfig becomes plain settings (`RivaRequest`),
those the core's (`RivaServicer`), and the core's results and errors Riva messages and gRPC statuses
naming Riva's fields. Two Riva conventions live here because they are the protocol's: a stream whose
first bytes are a WAV header (riva.client streams files that way) takes its format from it, and several
channels without enable_separate_recognition_per_channel mean the first channel only. What Riva has and
this server does not, and whose silent absence would change what a result means (negative word
boosts, a language the model does not serve, an encoding it cannot decode), is refused
with INVALID_ARGUMENT naming the Riva field; options that only shape formatting are accepted and named
in the `asr-hints` initial metadata (docs/operations.md, "The Riva door").
"""
