"""Fetching a diffusers-layout repo from the Hugging Face hub, only the files sdx reads.

`fetch(repo_id)` reads model_index.json first, lists the repo, and downloads through huggingface_hub
(its cache, token, HF_ENDPOINT and HF_HUB_OFFLINE apply) just: model_index.json, each model's
config.json and its chosen safetensors weights (the `variant`, e.g. fp16, when asked and present; never
`.bin`/`.ckpt` pickles, never the other variant), the tokenizer folders and the scheduler config. With
HF_HUB_OFFLINE=1 (or when the hub cannot be reached) the cached snapshot is used as it is. Anything
that stops the fetch is one SdxError naming the repo id.

The hub is asked once per process whether it answers (`reachable`: HF_ENDPOINT, `PROBE_SECONDS`), before
the first request; when it does not, huggingface_hub is put offline for the rest of the process, so a machine
without the hub gets the cache, or one error line, in seconds instead of a request retried five times.
"""

from __future__ import annotations

import contextlib
import re
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx2
from huggingface_hub import constants, hf_hub_download, list_repo_files, snapshot_download
from huggingface_hub.errors import (
    EntryNotFoundError,
    GatedRepoError,
    HfHubHTTPError,
    HFValidationError,
    LocalEntryNotFoundError,
    OfflineModeIsEnabled,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.utils import get_session

from convert.diffusers_folder import MODEL_INDEX, needed_files, parse_model_index
from sdx import io
from sdx.errors import SdxError

_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_UNREACHABLE = (httpx2.HTTPError, OfflineModeIsEnabled, ConnectionError, TimeoutError)


def looks_like_repo_id(text: str) -> bool:
    """`org/name` with the hub's characters (a local path that exists is never taken for one)."""
    return bool(_REPO_ID.match(text)) and ".." not in text


PROBE_SECONDS = 3.0  # how long the one probe of the hub waits for an answer
_unreachable: str | None = None  # why the probe found the hub unreachable (it then ran, and the process is offline)
_probed = False


def _offline() -> bool:
    return constants.is_offline_mode()


def reachable() -> bool:
    """Whether the hub answers: asked once per process (unless HF_HUB_OFFLINE is set), any HTTP answer within
    `PROBE_SECONDS` counting (a slow name lookup included: the probe runs in a thread of its own). When it does
    not answer, huggingface_hub is offline for the rest of the process: the local cache serves what it holds,
    and nothing waits on the network again."""
    global _probed, _unreachable
    if not _probed and not _offline():
        _probed = True
        failed: list[str] = []

        def probe() -> None:
            try:
                get_session().head(constants.ENDPOINT, timeout=PROBE_SECONDS)
            except (httpx2.TransportError, OSError) as e:
                failed.append(_one_line(e))
            else:
                failed.append("")

        thread = threading.Thread(target=probe, name="sdx-hub-probe", daemon=True)
        thread.start()
        thread.join(PROBE_SECONDS)
        if not failed or failed[0]:
            _unreachable = f"{constants.ENDPOINT} gave no answer ({failed[0] if failed else f'in {PROBE_SECONDS:g} s'})"
            constants.HF_HUB_OFFLINE = True
    return not _offline()


def _why_offline() -> str:
    """Why the hub is not asked: the probe's finding, or HF_HUB_OFFLINE."""
    return f"the hub is unreachable: {_unreachable}" if _unreachable else "HF_HUB_OFFLINE is set"


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text[:300]}" if text else type(e).__name__


def fetch(
    repo_id: str,
    *,
    variant: str | None = None,
    revision: str | None = None,
    cache_dir: str | Path | None = None,
    token: str | bool | None = None,
    log: Callable[[str], None] | None = None,
) -> Path:
    """The local snapshot folder of `repo_id` holding (at least) the files sdx reads."""
    log = log or (lambda _msg: None)
    where = f"hub repo {repo_id!r}" + (f" (revision {revision})" if revision else "")
    kw = dict(revision=revision, cache_dir=cache_dir)
    with hub_errors(where, missing=f"has no {MODEL_INDEX}, so it is not a diffusers-layout repo"):
        files = _online_listing(repo_id, revision, token, where, log)
        if files is not None:
            index_path = Path(hf_hub_download(repo_id, MODEL_INDEX, token=token, **kw))
            index = parse_model_index(io.read_json(index_path), where=f"{where}: {MODEL_INDEX}")
            wanted = needed_files(index, files, variant, where=where)
            log(f"{where}: fetching {len(wanted)} files")
            return Path(snapshot_download(repo_id, allow_patterns=wanted, token=token, **kw))
        # Offline: the cached snapshot, as it is; the folder reader reports what it lacks.
        index_path = Path(hf_hub_download(repo_id, MODEL_INDEX, local_files_only=True, **kw))
        log(f"{where}: {_why_offline()}; using the cached snapshot")
        return index_path.parent


def _online_listing(repo_id: str, revision, token, where: str, log) -> list[str] | None:
    """The repo's file list, or None when offline (HF_HUB_OFFLINE) or the hub cannot be reached: the
    callers then fall back to the local cache."""
    if not reachable():
        return None
    try:
        return list_repo_files(repo_id, revision=revision, token=token)
    except _UNREACHABLE as e:
        log(f"{where}: hub unreachable ({_one_line(e)}); using the local cache")
        return None


@contextlib.contextmanager
def hub_errors(where: str, *, missing: str) -> Iterator[None]:
    """Turn what huggingface_hub raises into one SdxError naming `where` (the repo id); `missing`: what
    to say when a file the caller asked for is not in the repo."""
    try:
        yield
    except (RepositoryNotFoundError, GatedRepoError) as e:
        raise SdxError(f"{where}: not found or not accessible (private or gated: log in with `hf auth login`) "
                       f"[{_one_line(e)}]") from None
    except RevisionNotFoundError:
        raise SdxError(f"{where}: revision not found") from None
    except LocalEntryNotFoundError:
        how = _why_offline() if _offline() else "the hub could not be reached"
        raise SdxError(f"{where}: not in the local cache, and {how}; give a local folder or file instead, or "
                       "fetch it once where the hub answers (the cache then serves it; HF_HUB_OFFLINE=1 skips the "
                       "hub)") from None
    except EntryNotFoundError:
        raise SdxError(f"{where}: {missing}") from None
    except HFValidationError as e:
        raise SdxError(f"{where}: not a valid repo id ({_one_line(e)})") from None
    except (HfHubHTTPError, *_UNREACHABLE) as e:
        raise SdxError(f"{where}: could not be fetched ({_one_line(e)})") from None



# --------------------------------------------------------------------------------------------------
# Single files and model folders other than pipelines (--lora, --vae, --unet)

_FILE_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)/(?P<file>[\w.-]+(/[\w.-]+)*)$")


def split_hub_path(text: str) -> tuple[str, str | None] | None:
    """'org/name' -> ('org/name', None); 'org/name/sub/file.safetensors' -> ('org/name', 'sub/file.safetensors');
    anything else (a local-looking path, `..`) -> None."""
    if ".." in text:
        return None
    if looks_like_repo_id(text):
        return text, None
    m = _FILE_ID.match(text)
    return (m["repo"], m["file"]) if m else None


def fetch_files(
    repo_id: str,
    choose: Callable[[list[str]], list[str]],
    *,
    revision: str | None = None,
    cache_dir: str | Path | None = None,
    token: str | bool | None = None,
    log: Callable[[str], None] | None = None,
) -> Path:
    """The local snapshot folder of `repo_id` with the files `choose(listing)` picks from the repo's file
    list (repo-relative paths); `choose` raises an SdxError when the repo lacks what it wants. Offline
    (or with the hub unreachable), `choose` picks from the cached snapshot instead."""
    log = log or (lambda _msg: None)
    where = f"hub repo {repo_id!r}" + (f" (revision {revision})" if revision else "")
    kw = dict(revision=revision, cache_dir=cache_dir)
    with hub_errors(where, missing="lacks a file it should have"):
        files = _online_listing(repo_id, revision, token, where, log)
        if files is not None:
            wanted = choose(sorted(files))
            log(f"{where}: fetching {', '.join(wanted)}")
            return Path(snapshot_download(repo_id, allow_patterns=wanted, token=token, **kw))
        folder = Path(snapshot_download(repo_id, local_files_only=True, **kw))
        choose(sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()))
        log(f"{where}: {_why_offline()}; using the cached snapshot")
        return folder
