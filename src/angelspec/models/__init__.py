"""Pure-PyTorch models: the target decoder and (later) drafters and heads."""

from angelspec.models.config import ConfigError, DecoderConfig
from angelspec.models.decoder import CacheInputs, Decoder, DecoderOutput, TrainInputs
from angelspec.models.hf_io import CheckpointError, load_target, read_config, save_target
from angelspec.models.kv_cache import StaticKVCache

__all__ = ["CacheInputs", "CheckpointError", "ConfigError", "Decoder", "DecoderConfig", "DecoderOutput",
           "StaticKVCache", "TrainInputs", "load_target", "read_config", "save_target"]
