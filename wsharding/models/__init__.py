"""Models written with wsharding's linears: a small decoder shaped like the deployment of
SGLang's weight sharding for Kimi K3."""

from wsharding.models.decoder import PRESETS, DecoderConfig, ToyDecoder, build_pair, decoder_config

__all__ = ["PRESETS", "DecoderConfig", "ToyDecoder", "build_pair", "decoder_config"]
