"""Configuration: one TOML file into frozen dataclasses; defaults < file < overrides
(statecache/config/sections.py)."""

from statecache.config.sections import (
    HOSTED_TOOLS,
    INNER_SYSTEM,
    LOG_LEVELS,
    SPECULATIVE_SOURCES,
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
    get_value,
    load_config,
)

__all__ = ["HOSTED_TOOLS", "INNER_SYSTEM", "LOG_LEVELS", "SPECULATIVE_SOURCES", "CacheConfig",
           "Config", "ConfigError", "EngineConfig", "LogConfig", "ModelConfig", "RemoteConfig",
           "SamplingConfig", "ServerConfig", "SpeculativeConfig", "VolatileRule", "get_value",
           "load_config"]
