"""The attention KV inside a llama.cpp sequence state, cut into pages and put back
(statecache/kvpages/layout.py)."""

from statecache.kvpages.layout import (
    REST_HEAD_BYTES,
    SEQ_MAGIC,
    BadState,
    PageData,
    PageKey,
    RestInfo,
    Split,
    assemble,
    key_bytes,
    page_bytes,
    page_key,
    page_nbytes,
    rest_info,
    rest_logits,
    split,
    unpack_keys,
    whole_state,
)

__all__ = ["REST_HEAD_BYTES", "SEQ_MAGIC", "BadState", "PageData", "PageKey", "RestInfo",
           "Split", "assemble", "key_bytes", "page_bytes", "page_key", "page_nbytes",
           "rest_info", "rest_logits", "split", "unpack_keys", "whole_state"]
