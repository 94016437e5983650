"""Configuration: one TOML file (load.py) into frozen dataclasses (sections.py);
defaults < file < overrides."""

from statecache.config.load import get_value, load_config
from statecache.config.sections import (
    HOSTED_TOOLS,
    INNER_SYSTEM,
    LOG_LEVELS,
    SPECULATIVE_SOURCES,
    TOOL_FORMATS,
    CacheConfig,
    Config,
    ConfigError,
    EngineConfig,
    LogConfig,
    ModelConfig,
    RemoteConfig,
    SamplingConfig,
    ServerConfig,
    SpeculativeConfig,
    VolatileRule,
)

__all__ = ["HOSTED_TOOLS", "INNER_SYSTEM", "LOG_LEVELS", "SPECULATIVE_SOURCES", "TOOL_FORMATS",
           "CacheConfig",
           "Config", "ConfigError", "EngineConfig", "LogConfig", "ModelConfig", "RemoteConfig",
           "SamplingConfig", "ServerConfig", "SpeculativeConfig", "VolatileRule", "get_value",
           "load_config"]
