"""The attention KV inside a llama.cpp sequence state, cut into pages and put back.

Every FULL checkpoint of a conversation holds the KV of every token before it, so
its checkpoints share most of their bytes. ``split`` (split.py) cuts a state into the
KV of each whole page of tokens (per KV section: plain attention has one, iSWA two)
and the *rest* (headers, the cells' metadata, the KV of a last partial page, a
hybrid's recurrent state); ``assemble`` (assemble.py) puts back exactly the bytes
that were cut, checked by a digest of the whole state. A page is named by its content
(page.py); what llama.cpp writes is read in layout.py.
"""

from statecache.kvpages.assemble import assemble, rest_logits, whole_state
from statecache.kvpages.layout import REST_HEAD_BYTES, SEQ_MAGIC, BadState, RestInfo, rest_info
from statecache.kvpages.page import (
    PageData,
    PageKey,
    key_bytes,
    page_bytes,
    page_key,
    page_nbytes,
    unpack_keys,
)
from statecache.kvpages.split import Split, split

__all__ = ["REST_HEAD_BYTES", "SEQ_MAGIC", "BadState", "PageData", "PageKey", "RestInfo",
           "Split", "assemble", "key_bytes", "page_bytes", "page_key", "page_nbytes",
           "rest_info", "rest_logits", "split", "unpack_keys", "whole_state"]
