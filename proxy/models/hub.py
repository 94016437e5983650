"""A Hugging Face repo's GGUF, downloaded as llama-server's ``-hf org/repo[:quant]`` does,
with ``huggingface_hub`` and so on its terms: into its cache (``hfcache.root``), with
``HF_TOKEN`` (or a saved login) for private and gated repos, from ``HF_ENDPOINT`` (a
mirror), resuming a download that stopped, and with its progress bars. The repo's file
list picks the file (``quants``' rule); a split model comes down whole and loads from its
first part. ``HF_HUB_OFFLINE=1`` turns this off.

``huggingface_hub`` is imported only here, only when a download is needed.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from proxy.models.quants import ModelFile, choose, group
from statecache.sizes import format_size

log = logging.getLogger("statecache")

DEFAULT_ENDPOINT = "https://huggingface.co"


class DownloadFailed(FileNotFoundError):
    """The Hub did not give the file; the message says what it answered."""


def endpoint() -> str:
    return (os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")


def offline() -> bool:
    return (os.environ.get("HF_HUB_OFFLINE") or "").strip().lower() in ("1", "true", "yes", "on")


def download(repo_id: str, quant: str, fits: Callable[[ModelFile], bool],
             cache_dir: Path) -> Path:
    """The local path of the first part of ``repo_id``'s GGUF that ``quant`` names,
    downloading every part into ``cache_dir`` that is not there yet."""
    from huggingface_hub import HfApi, hf_hub_download
    from huggingface_hub.hf_api import RepoFile

    where = endpoint()
    with _answers(repo_id, where):
        tree = list(HfApi(endpoint=where).list_repo_tree(repo_id, recursive=True))
    chosen = choose(group((f.path, int(f.size)) for f in tree if isinstance(f, RepoFile)),
                    quant, fits, f"{repo_id} at {where}")
    log.info("downloading %s from %s: %s (%s%s) into %s", repo_id, where, chosen.first,
             format_size(chosen.size),
             f", {len(chosen.parts)} parts" if len(chosen.parts) > 1 else "", cache_dir)
    with _answers(repo_id, where):
        paths = [hf_hub_download(repo_id, rel, cache_dir=str(cache_dir), endpoint=where)
                 for rel in chosen.parts]
    return Path(str(paths[0]))


@contextmanager
def _answers(repo_id: str, where: str) -> Iterator[None]:
    """What the Hub answered, as a DownloadFailed that says it in a line."""
    import httpx2
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, RepositoryNotFoundError

    try:
        yield
    except GatedRepoError:
        raise DownloadFailed(f"{repo_id} at {where} is gated: accept its terms on the Hub, "
                             "then set HF_TOKEN (or `hf auth login`)") from None
    except RepositoryNotFoundError:
        raise DownloadFailed(f"no repo {repo_id} at {where} (a private repo needs HF_TOKEN)"
                             ) from None
    except HfHubHTTPError as e:
        status = e.response.status_code if e.response is not None else "?"
        raise DownloadFailed(f"{where} answered HTTP {status} for {repo_id}") from None
    except (httpx2.TransportError, OSError) as e:
        raise DownloadFailed(f"cannot download {repo_id} from {where}: "
                             f"{type(e).__name__}: {e}") from None
