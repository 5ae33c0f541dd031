"""Hugging Face repo ids as model sources: `org/name`, `org/name@revision`, and `org/name:QUANT` for the
.gguf file (or split parts) of one quantization in a GGUF repo. Fetched with huggingface_hub into its
standard cache (HF_HOME / HF_HUB_CACHE, HF_HUB_OFFLINE, HF_ENDPOINT and the usual tokens are all its own),
only the files moestream reads, each checked against the size the hub lists for it.

What resumes: a connection dropped mid-file continues with a Range request inside the same run
(huggingface_hub's retry); files already complete are never fetched again; a file stopped by Ctrl-C, a
kill, a full disk or a dead network continues in the next run from the last 10 MiB piece written
(_fetch). Files served through Xet are huggingface_hub's alone.

huggingface_hub is imported only when a download runs: the CLI imports this module for its parser."""

from __future__ import annotations

import argparse
import errno
import re
import shutil
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from .atomic import atomic_write
from .errors import InputError, IntegrityError, MoeStreamError

# ---- ids ----------------------------------------------------------------------------------------

# One side of org/name as the hub allows it: ASCII word characters, '-' and '.', at most 96, starting
# and ending with a word character, no '--' or '..' (checked apart).
_PART = r"[A-Za-z0-9_](?:[A-Za-z0-9_.-]{0,94}[A-Za-z0-9_])?"
# A branch, tag or commit: git refs never hold ':', '@{', spaces or '~^?*[\', so '@' and ':' delimit.
_REVISION = r"[A-Za-z0-9_][A-Za-z0-9_./-]{0,199}"
# A quantization label as GGUF file names carry it: Q4_K_M, IQ2_XXS, BF16, UD-Q4_K_XL.
_QUANT = r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}"
_HUB_ID = re.compile(
    rf"(?P<repo>{_PART}/{_PART})(?::(?P<q1>{_QUANT}))?(?:@(?P<rev>{_REVISION}))?(?::(?P<q2>{_QUANT}))?", re.ASCII
)
# Names that are file names, not repos: a mistyped path to a file is reported as missing, not looked up.
_FILE_SUFFIXES = (".gguf", ".safetensors", ".json", ".bin")
_COMMIT = re.compile(r"[0-9a-f]{40}")


@dataclass(frozen=True)
class HubId:
    repo_id: str  # org/name
    revision: str | None = None  # None: the repo's default branch
    quant: str | None = None  # a GGUF repo's quantization (Q4_K_M); None: its checkpoint or only GGUF

    def __str__(self) -> str:
        return self.repo_id + (f":{self.quant}" if self.quant else "") + (f"@{self.revision}" if self.revision else "")


def _valid_revision(rev: str) -> bool:
    return re.fullmatch(_REVISION, rev, re.ASCII) is not None and not (
        ".." in rev or "//" in rev or rev.endswith(("/", ".", ".lock"))
    )


def parse_hub_id(text: str) -> HubId | None:
    """The repo id text names, or None when it cannot be one (a path such as ./x, /x, x/y/z or x.gguf,
    characters the hub refuses)."""
    m = _HUB_ID.fullmatch(text)
    if m is None or (m["q1"] and m["q2"]):
        return None
    repo, rev = m["repo"], m["rev"]
    if "--" in repo or ".." in repo or repo.lower().endswith(_FILE_SUFFIXES):
        return None
    if rev is not None and not _valid_revision(rev):
        return None
    return HubId(repo, rev, m["q1"] or m["q2"])


# ---- which files a model needs ------------------------------------------------------------------

CONFIG_FILES = ("config.json", "generation_config.json")
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "tiktoken.model",
    "vocab.json",
    "merges.txt",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
)
# tokenization_*.py holds a tiktoken model's pre-tokenizer pattern (read as text, never run).
TOKENIZER_PATTERNS = (re.compile(r"tokenization_[\w.-]*\.py"), re.compile(r"[\w.-]+\.tiktoken"))
PACKED_FILES = ("manifest.json", "trunk.bin", "experts.bin")  # a store written by `moestream pack`
_SPLIT = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$", re.IGNORECASE)


def _model_files(top: set[str]) -> list[str]:
    return sorted(
        f for f in top if f in CONFIG_FILES or f in TOKENIZER_FILES or any(p.fullmatch(f) for p in TOKENIZER_PATTERNS)
    )


def _quant_label(path: str) -> str:
    """The quantization a GGUF file name carries, for messages: the last '-' or '.' field of its stem."""
    stem = _SPLIT.sub("", path)
    stem = stem[: -len(".gguf")] if stem.lower().endswith(".gguf") else stem
    return re.split(r"[-.]", PurePosixPath(stem).name)[-1]


def _gguf_group(paths: list[str], hub_id: HubId) -> list[str]:
    """The parts of the one GGUF model among paths (a single file, or every -0000k-of-0000N part in
    order); several models or missing parts are one line each."""
    groups: dict[str, dict[int, str]] = {}
    counts: dict[str, int] = {}
    for p in paths:
        m = _SPLIT.search(p)
        key = _SPLIT.sub("", p) if m else p
        groups.setdefault(key, {})[int(m[1]) if m else 1] = p
        counts[key] = int(m[2]) if m else 1
    if len(groups) > 1:
        labels = sorted({_quant_label(p) for p in paths})
        what = f"several .gguf files for {hub_id.quant}" if hub_id.quant else "several GGUF models"
        raise InputError(
            f"{hub_id}: {what} ({', '.join(sorted(groups)[:6])}); pick one with {hub_id.repo_id}:QUANT "
            f"(found: {', '.join(labels[:12])})"
        )
    ((key, parts),) = groups.items()
    missing = [i for i in range(1, counts[key] + 1) if i not in parts]
    if missing:
        raise InputError(f"{hub_id}: split GGUF {key} lacks part {missing[0]} of {counts[key]} on the hub")
    return [parts[i] for i in sorted(parts)]


def select_files(files: list[str], hub_id: HubId) -> tuple[str, list[str]]:
    """("checkpoint" | "packed" | "gguf", the repo files the model needs; for a GGUF the parts in order).

    Only top-level files make a checkpoint (subfolders hold other formats); pytorch .bin weights,
    other quantizations, images and docs are never fetched."""
    top = {f for f in files if "/" not in f}
    ggufs = sorted(f for f in files if f.lower().endswith(".gguf") and "mmproj" not in PurePosixPath(f).name.lower())
    if hub_id.quant is not None:
        quant = re.compile(rf"(?:^|[-./]){re.escape(hub_id.quant)}(?=[-./])", re.IGNORECASE)
        picked = [f for f in ggufs if quant.search(f)]
        if not picked:
            found = sorted({_quant_label(f) for f in ggufs})
            raise InputError(
                f"{hub_id}: no .gguf file for {hub_id.quant} in {hub_id.repo_id}"
                + (f" (found: {', '.join(found[:12])})" if found else " (it has no .gguf files)")
            )
        return "gguf", _gguf_group(picked, hub_id)
    if all(f in top for f in PACKED_FILES):
        return "packed", sorted(set(PACKED_FILES) | set(_model_files(top)))
    weights = sorted(f for f in top if f.endswith(".safetensors") or f.endswith(".safetensors.index.json"))
    if any(f.endswith(".safetensors") for f in weights):
        if "config.json" not in top:
            raise InputError(f"{hub_id}: safetensors weights but no config.json at the top of {hub_id.repo_id}")
        return "checkpoint", sorted(set(weights) | set(_model_files(top)))
    if ggufs:
        return "gguf", _gguf_group(ggufs, hub_id)
    raise InputError(
        f"{hub_id}: no safetensors weights and no .gguf files in {hub_id.repo_id} "
        "(moestream reads safetensors checkpoints, GGUF files and packed stores, not pytorch .bin)"
    )


# ---- download -----------------------------------------------------------------------------------


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__


def _hub_error(e: Exception, hub_id: HubId) -> MoeStreamError | None:
    """e as one line when it is the hub's answer about the repo (gated, missing, revision), a full disk
    or an unwritable cache; None for everything else (the hub could not be reached)."""
    from huggingface_hub import constants
    from huggingface_hub import errors as hf

    login = "log in with `hf auth login` or set HF_TOKEN"
    if isinstance(e, hf.GatedRepoError):
        return InputError(f"{hub_id}: a gated repo; accept its conditions on the Hugging Face hub, then {login}")
    if isinstance(e, hf.RevisionNotFoundError):
        return InputError(f"{hub_id}: no revision {hub_id.revision or 'main'!r} in {hub_id.repo_id}")
    if isinstance(e, hf.RepositoryNotFoundError):
        private = "" if constants.HF_HUB_OFFLINE else f" (if it is private, {login})"
        return InputError(f"{hub_id}: no such model on the Hugging Face hub{private}{_path_hint(hub_id)}")
    if isinstance(e, hf.DisabledRepoError):
        return InputError(f"{hub_id}: the repo is disabled on the Hugging Face hub")
    if isinstance(e, hf.EntryNotFoundError) and not isinstance(e, hf.LocalEntryNotFoundError):
        return InputError(f"{hub_id}: a file the listing names is missing on the hub ({_first_line(e)})")
    if isinstance(e, hf.HfHubHTTPError):
        status = e.response.status_code if e.response is not None else None
        if status is not None and status < 500:
            return InputError(f"{hub_id}: the Hugging Face hub refused the request (HTTP {status})")
        return None
    if isinstance(e, OSError) and e.errno == errno.ENOSPC:
        return InputError(f"{hub_id}: the disk of the Hugging Face cache ({constants.HF_HUB_CACHE}) is full")
    if isinstance(e, OSError) and e.errno in (errno.EACCES, errno.EROFS, errno.EPERM):
        return InputError(f"{hub_id}: cannot write the Hugging Face cache ({e.strerror}: {e.filename})")
    return None


def _path_hint(hub_id: HubId) -> str:
    """For models/qwen where ./models exists: the user likely meant a local path, which is not there."""
    org = hub_id.repo_id.split("/")[0]
    return f"; nor is there a local {hub_id.repo_id}" if Path(org).is_dir() else ""


def _unreachable(why: Exception) -> str:
    """Why the hub was not asked: offline mode, or the error reaching it."""
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return "HF_HUB_OFFLINE is set"
    return f"cannot reach the Hugging Face hub at {constants.ENDPOINT} ({_first_line(why)})"


def _storage(repo_id: str) -> Path:
    from huggingface_hub import constants
    from huggingface_hub.file_download import repo_folder_name

    return Path(constants.HF_HUB_CACHE).expanduser() / repo_folder_name(repo_id=repo_id, repo_type="model")


def _local_files(folder: Path) -> dict[str, int | None]:
    return {p.relative_to(folder).as_posix(): p.stat().st_size for p in folder.rglob("*") if p.is_file()}


def _from_cache(hub_id: HubId, why: Exception) -> tuple[str, Path, list[str]]:
    """The model's files in the cache, when the hub cannot be reached (offline mode, no network, a hub
    error): the snapshot the revision last resolved to, with the same files an online run would pick
    (from the hub's own cached listing when it kept one, else from what is on disk), all present."""
    import huggingface_hub as hf

    storage = _storage(hub_id.repo_id)
    rev = hub_id.revision or "main"
    sha: str | None = rev if _COMMIT.fullmatch(rev) else None
    ref = storage / "refs" / rev
    if sha is None and ref.is_file():
        sha = ref.read_text().strip()
    snapshot = storage / "snapshots" / (sha or "-")
    if sha is None or not snapshot.is_dir():
        from huggingface_hub import constants

        cache = constants.HF_HUB_CACHE
        raise InputError(f"{hub_id}: not in the Hugging Face cache ({cache}); {_unreachable(why)}{_path_hint(hub_id)}")
    listing: dict[str, int | None]
    try:  # the listing of the commit as snapshot_download cached it (huggingface_hub >= 2)
        listing = {f.path: f.size for f in hf.get_cached_repo_tree(hub_id.repo_id, revision=sha)}
    except Exception:  # an older huggingface_hub, or a cache another tool wrote
        listing = _local_files(snapshot)
    kind, files = select_files(sorted(listing), hub_id)
    _check_present(hub_id, snapshot, files, listing, why)
    return kind, snapshot, files


def _check_present(
    hub_id: HubId, snapshot: Path, files: list[str], listing: dict[str, int | None], why: Exception
) -> None:
    missing = [f for f in files if not (snapshot / f).is_file()]
    index = snapshot / "model.safetensors.index.json"
    if not missing and index.is_file():  # a listing read from disk cannot tell that a shard never arrived
        import json

        try:
            shards = set(json.loads(index.read_text())["weight_map"].values())
        except (ValueError, KeyError, TypeError, AttributeError):
            shards = set()
        missing = sorted(s for s in shards if isinstance(s, str) and not (snapshot / s).is_file())
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise InputError(f"{hub_id}: the cached copy lacks {missing[0]}{more}; {_unreachable(why)}")
    _check_sizes(hub_id, snapshot, files, listing)


def _check_sizes(hub_id: HubId, folder: Path, files: list[str], listing: dict[str, int | None]) -> None:
    """Each file has the size the hub lists; a wrong one is taken out of the cache (the link and the blob
    it points to) so that the next run fetches it again."""
    for f in files:
        want = listing.get(f)
        path = folder / f
        try:
            got = path.stat().st_size
        except FileNotFoundError:
            raise IntegrityError(f"{hub_id}: {f} is missing from {folder} after the download") from None
        if want is not None and got != want:
            blob = path.resolve()
            path.unlink(missing_ok=True)
            if blob != path:
                blob.unlink(missing_ok=True)
            raise IntegrityError(f"{hub_id}: {f} has {got} bytes, the hub lists {want}; removed it, run again")


def _size(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


def _check_space(hub_id: HubId, folder: Path, files: list[str], listing: dict[str, int | None]) -> None:
    """Refuse before fetching when the files still missing cannot fit the cache's disk."""
    need = sum(listing.get(f) or 0 for f in files if not (folder / f).exists())
    where = folder
    while not where.exists() and where != where.parent:
        where = where.parent
    try:
        free = shutil.disk_usage(where).free
    except OSError:
        return
    if need > free:
        raise InputError(f"{hub_id}: needs {_size(need)} in {where}, which has {_size(free)} free")


@contextmanager
def _progress_bars(show: bool) -> Iterator[None]:
    """huggingface_hub's bars off while a quiet download runs (its switch is global; HF_HUB_DISABLE_PROGRESS_BARS
    still wins)."""
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

    if show or are_progress_bars_disabled():
        yield
        return
    disable_progress_bars()
    try:
        yield
    finally:
        enable_progress_bars()


def download(hub_id: HubId, *, progress: bool = True, config_only: bool = False) -> Path:
    """The model hub_id names, fetched into the Hugging Face cache (only what is not there yet): the
    snapshot directory of a checkpoint or packed store, or the first .gguf part of a GGUF pick.
    config_only: of a checkpoint, just its config.json (what `inspect` needs)."""
    import huggingface_hub as hf

    try:
        info = hf.HfApi().model_info(hub_id.repo_id, revision=hub_id.revision, files_metadata=True)
    except Exception as e:
        error = _hub_error(e, hub_id)
        if error is not None:
            raise error from None
        kind, folder, files = _from_cache(hub_id, e)  # offline, no network, or the hub is down
        return folder / files[0] if kind == "gguf" else folder
    if info.sha is None or not _COMMIT.fullmatch(info.sha):
        raise InputError(f"{hub_id}: the hub gave no commit for the revision (is HF_ENDPOINT a hub?)")
    listing: dict[str, int | None] = {s.rfilename: s.size for s in info.siblings or []}
    kind, files = select_files(sorted(listing), hub_id)
    if config_only and kind == "checkpoint":
        files = [f for f in files if f == "config.json"]
    folder = _storage(hub_id.repo_id) / "snapshots" / info.sha
    todo = [f for f in files if not (folder / f).exists()]
    if todo:
        _check_space(hub_id, folder, todo, listing)
        if progress:
            size = sum(listing.get(f) or 0 for f in todo)
            print(f"{hub_id}: fetching {len(todo)} files, {_size(size)}, into {folder}", file=sys.stderr)
    try:
        # One file at a time, in this thread: Ctrl-C then stops at once (snapshot_download's thread pool
        # finishes every file in flight first). Each file is pinned to the listed commit, so a branch that
        # moves meanwhile cannot mix two commits.
        with _progress_bars(progress):
            for f in files:
                _fetch(hub_id, f, info.sha)
    except MoeStreamError:
        raise
    except Exception as e:
        error = _hub_error(e, hub_id)
        if error is None:
            raise InputError(f"{hub_id}: the download failed ({_first_line(e)}); run again to continue") from None
        raise error from None
    _check_sizes(hub_id, folder, files, listing)
    _record_ref(hub_id, info.sha)
    return folder / files[0] if kind == "gguf" else folder


def _fetch(hub_id: HubId, filename: str, sha: str) -> None:
    """One file into the cache. huggingface_hub downloads into a temporary file of its own process and
    deletes it when stopped, so a Ctrl-C or a lost connection in a 20 GB shard would start it over; we
    keep the bytes in blobs/ETAG.incomplete (the name earlier huggingface_hub versions resumed too),
    resume it with a Range request, check a resumed file's SHA-256 when its ETag is one, and hand the
    complete blob to hf_hub_download, which links it into the snapshot. Files served through Xet, or
    whose partial file another process is writing, are left to huggingface_hub."""
    import fcntl
    from urllib.parse import urlsplit

    import huggingface_hub as hf
    from huggingface_hub.file_download import http_get
    from huggingface_hub.utils import build_hf_headers

    snapshot = _storage(hub_id.repo_id) / "snapshots" / sha
    if not (snapshot / filename).exists():
        url = hf.hf_hub_url(hub_id.repo_id, filename, revision=sha)
        meta = hf.get_hf_file_metadata(url)
        blob = _storage(hub_id.repo_id) / "blobs" / (meta.etag or "-")
        if meta.etag and meta.size and getattr(meta, "xet_file_data", None) is None and not blob.exists():
            headers = build_hf_headers(headers={"Accept-Encoding": "identity"})  # ranges of the raw bytes
            if urlsplit(meta.location).netloc != urlsplit(url).netloc:
                headers.pop("authorization", None)  # a signed CDN address: the token stays with the hub
            partial = blob.with_name(blob.name + ".incomplete")
            partial.parent.mkdir(parents=True, exist_ok=True)
            with open(partial, "ab+") as f:
                try:
                    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    pass  # another process is on it: huggingface_hub's own lock and names take over
                else:
                    done = f.seek(0, 2)
                    if done > meta.size:
                        f.truncate(0)
                        done = f.seek(0, 2)
                    try:
                        http_get(
                            meta.location,
                            f,
                            resume_size=done,
                            headers=headers,
                            expected_size=meta.size,
                            displayed_filename=filename,
                        )
                    except BaseException:
                        if f.seek(0, 2) == 0:
                            partial.unlink(missing_ok=True)  # nothing to resume: leave no empty file behind
                        raise
                    f.flush()
                    if done:
                        _check_digest(hub_id, filename, partial, meta.etag)
                    partial.replace(blob)
    hf.hf_hub_download(hub_id.repo_id, filename, revision=sha)


def _check_digest(hub_id: HubId, filename: str, path: Path, etag: str) -> None:
    """A file pieced together from two runs has the SHA-256 its ETag names (the hub's ETag of a large file
    is its SHA-256; a 40-digit git ETag is not checked)."""
    import hashlib

    if not re.fullmatch(r"[0-9a-f]{64}", etag):
        return
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    if h.hexdigest() != etag:
        path.unlink(missing_ok=True)
        raise IntegrityError(f"{hub_id}: {filename} pieced from two runs fails its SHA-256; removed it, run again")


def _record_ref(hub_id: HubId, sha: str) -> None:
    """refs/REVISION -> sha in the cache, as huggingface_hub keeps it, so that an offline run finds the
    snapshot by the revision's name (downloads pinned to a commit do not record it)."""
    rev = hub_id.revision or "main"
    if rev == sha:
        return
    ref = _storage(hub_id.repo_id) / "refs" / rev
    try:
        if ref.is_file() and ref.read_text().strip() == sha:
            return
        ref.parent.mkdir(parents=True, exist_ok=True)
        with atomic_write(ref, "w") as f:
            f.write(sha)
    except OSError:
        pass  # a read-only cache still serves this run; only an offline run later misses the name


# ---- moestream download -------------------------------------------------------------------------


def add_download_parser(sub: Any) -> argparse.ArgumentParser:
    d: argparse.ArgumentParser = sub.add_parser(
        "download",
        help="fetch a Hugging Face model into the hub's cache without running it",
        description="Fetch the files a model needs (config, tokenizer, chat template, safetensors; or the "
        ".gguf parts of one quantization) into the Hugging Face cache (HF_HOME, HF_HUB_CACHE; tokens from "
        "HF_TOKEN or `hf auth login`) and print the local path, which every command also takes. A run "
        "that stops keeps the files it completed, and the next one continues the file it was in.",
    )
    d.add_argument("id", metavar="ID", help="org/name, org/name@revision, or org/name:QUANT in a GGUF repo")
    d.add_argument("--revision", help="a branch, tag or commit (the same as ID@revision)")
    d.add_argument("--quiet", "-q", action="store_true", help="no progress bar")
    return d


def cmd_download(args: argparse.Namespace) -> int:
    hub_id = parse_hub_id(args.id)
    if hub_id is None:
        raise InputError(f"{args.id[:200]!r} is not a Hugging Face id (org/name, org/name@revision, org/name:QUANT)")
    if args.revision is not None:
        if not _valid_revision(args.revision):
            raise InputError(f"--revision: {args.revision[:200]!r} is not a branch, tag or commit")
        if hub_id.revision not in (None, args.revision):
            raise InputError(f"--revision {args.revision} contradicts {args.id}")
        hub_id = HubId(hub_id.repo_id, args.revision, hub_id.quant)
    print(download(hub_id, progress=not args.quiet))
    return 0
