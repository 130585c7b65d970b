"""The on-disk cache of `check` reports: a run over an unchanged tree only stats its files.

Layout, like ruff's: `<cache dir>/<version>/<shard>.json`, in a cache directory (default
`.gaaudit_cache/` at the project root) that holds a `.gitignore` of `*`. There is one shard
per checked folder and run key. The run key digests what all findings depend on besides
the files: gaaudit's version and code, and the settings that filter findings. A shard maps
file names to entries:

- the file's stat signature when it was read: while it is unchanged, the entry answers
  without the file being read;
- the digest of its bytes: when only the stat changed (a checkout, a touch), the file is
  read and hashed, and an equal digest reuses the report without analysing it again;
- its dependencies, the other files the report was made from, with their signatures: the
  JSON files its source names (DeepSpeed configs) and the modules of the repository its
  loss helpers come from (`Context.dependencies`); any change there re-analyses the file;
- the report, without paths (a report carries the path as shown in the current run).

A file changed within the last `RACY_NS` may change again within the same timestamp
tick: its signature is not trusted. Unreadable, corrupt or foreign shards are ignored;
shards are written to a temporary file and renamed, so that concurrent runs never see a
partial shard (the last writer wins, and every entry checks itself when used). The cache
trusts its directory: one you did not write (committed to a repository under review)
could hide findings, so such runs want `--no-cache`.
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass, replace
from pathlib import Path

from gaaudit import __version__
from gaaudit.findings import Confidence, FileError, FileReport, Finding, Span

DIRECTORY = ".gaaudit_cache"
RACY_NS = 2_000_000_000
# String literals naming JSON files, configs the analysis may read beside the source (in a
# notebook's JSON, the closing quote is escaped).
NAMED_JSON = re.compile(rb"""["']([^"'\r\n]{1,255}?\.json)\\?["']""")
PACKAGE = Path(__file__).resolve().parent
CODE_SUFFIXES = (".py", ".toml", ".json")

Signature = tuple  # (size, mtime_ns, ctime_ns, inode); () for a missing file
Dependency = tuple[str, "Signature | None"]  # a path, and its signature when it was read


@dataclass(frozen=True)
class Entry:
    """What the cache knows about one file."""

    signature: Signature | None  # None: changed too recently to be trusted
    digest: str
    dependencies: tuple[Dependency, ...]  # other files the report was made from
    findings: tuple[Finding, ...]  # with empty paths: a report gets the path shown in its run
    error: FileError | None
    hidden: int = 0
    notes: tuple[str, ...] = ()
    fixable: int | None = None  # see FileReport

    def report(self, shown: str) -> FileReport:
        """The recorded report, with the file's path as shown in this run."""
        error = self.error and replace(self.error, path=shown)
        findings = [replace(f, path=shown) for f in self.findings]
        return FileReport(shown, findings, error, self.hidden, self.notes, self.fixable)


def digest(data: bytes) -> str:
    """A content digest (blake2b from its own module: hashlib would load OpenSSL too)."""
    from _blake2 import blake2b

    return blake2b(data, digest_size=16).hexdigest()


def signature(path: Path) -> Signature | None:
    """A file's stat signature; () when it does not exist, None when changed too recently."""
    try:
        info = os.stat(path)
    except (OSError, ValueError):
        return ()
    if time.time_ns() - max(info.st_mtime_ns, info.st_ctime_ns) < RACY_NS:
        return None
    return (info.st_size, info.st_mtime_ns, info.st_ctime_ns, info.st_ino)


def unchanged(dependencies: tuple[Dependency, ...]) -> bool:
    """Whether every dependency still has the signature it was recorded with."""
    return all(
        signed is not None and signed == signature(Path(name)) for name, signed in dependencies
    )


def named_files(source: bytes, folder: Path) -> list[Dependency]:
    """The JSON files a source names (the analysis reads DeepSpeed configs beside the file),
    signed before the analysis reads them."""
    names = {m.group(1).decode("utf-8", "replace") for m in NAMED_JSON.finditer(source)}
    return [(str(folder / name), signature(folder / name)) for name in sorted(names)]


def signed(dependencies) -> list[Dependency]:
    """The analysis's own dependencies (a path and the sha256 of the bytes it read, "" for
    a file it looked for and did not find), signed where the file still holds those bytes."""
    import hashlib

    found = []
    for dependency in sorted(dependencies):
        path = Path(dependency.path)
        stat = signature(path)
        try:
            now = hashlib.sha256(path.read_bytes()).hexdigest() if stat != () else ""
        except OSError:
            now = None
        found.append((dependency.path, stat if now == dependency.digest else None))
    return found


def record(
    signed: Signature | None, content: str, report: FileReport, dependencies: list[Dependency]
) -> Entry | None:
    """The entry for `report`, from the file's signature taken before it was read and the
    digest of its bytes; None for a report that must not be cached (an internal error)."""
    if report.error is not None and report.error.message.startswith("internal error"):
        return None
    findings = tuple(replace(f, path="") for f in report.findings)
    error = report.error and replace(report.error, path="")
    return Entry(
        signed or None,
        content,
        tuple(dependencies),
        findings,
        error,
        report.hidden,
        report.notes,
        report.fixable,
    )


def run_key(settings) -> str:
    """The digest of what every file's findings depend on besides the files themselves."""
    import json

    parts = [
        __version__,
        _code_fingerprint(),
        str(settings.root),
        sorted(settings.select),
        sorted(settings.ignore),
        [[glob, sorted(codes)] for glob, codes in settings.per_file_ignores],
        sorted(settings.accumulation_names),
        int(settings.min_confidence),
    ]
    return digest(json.dumps(parts).encode("utf-8"))


def _code_fingerprint() -> list:
    """Names, sizes and modification times of gaaudit's own files: a changed checkout of
    gaaudit (an editable install) must not reuse findings of its previous code."""
    from gaaudit.catalogue import catalogue_dir

    found = set()
    pending = [PACKAGE, catalogue_dir()]
    while pending:
        with os.scandir(pending.pop()) as entries:
            for item in entries:
                if item.is_dir(follow_symlinks=False) and item.name != "__pycache__":
                    pending.append(Path(item.path))
                elif item.name.endswith(CODE_SUFFIXES):
                    info = item.stat()
                    found.add((item.path, info.st_size, info.st_mtime_ns))
    return sorted(found)


class Cache:
    """Entries by file, read shard by shard as folders are visited, written by `save`."""

    def __init__(self, directory: Path, key: str) -> None:
        self.directory = directory
        self.key = key
        self._shards: dict[str, dict[str, Entry]] = {}
        self._changed: set[str] = set()

    def get(self, path: Path) -> Entry | None:
        folder, name = os.path.split(os.path.abspath(path))
        return self._shard(folder).get(name)

    def fresh(self, path: Path, entry: Entry) -> bool:
        """Whether `entry` still holds for `path` without reading it."""
        return (
            entry.signature is not None
            and entry.signature == signature(path)
            and unchanged(entry.dependencies)
        )

    def put(self, path: Path, entry: Entry | None) -> None:
        """Record `entry` for `path` (None forgets the file)."""
        folder, name = os.path.split(os.path.abspath(path))
        shard = self._shard(folder)
        if shard.get(name) != entry:
            if entry is None:
                shard.pop(name, None)
            else:
                shard[name] = entry
            self._changed.add(folder)

    def save(self) -> str | None:
        """Write the changed shards; a message saying why not, when the cache cannot be written."""
        if not self._changed:
            return None
        import json

        try:
            self._prepare()
            for folder in sorted(self._changed):
                entries = {name: _encode(e) for name, e in self._shard(folder).items()}
                _write_atomic(self._path(folder), json.dumps({"key": self.key, "entries": entries}))
        except OSError as exc:
            return f"cannot write the cache in {self.directory}: {exc.strerror or exc}; use --no-cache or --cache-dir"
        self._changed.clear()
        return None

    def _shard(self, folder: str) -> dict[str, Entry]:
        shard = self._shards.get(folder)
        if shard is None:
            shard = self._shards[folder] = self._load(folder)
        return shard

    def _load(self, folder: str) -> dict[str, Entry]:
        import json

        try:
            data = json.loads(self._path(folder).read_bytes())
            if data["key"] != self.key:
                return {}
            return {name: _decode(raw) for name, raw in data["entries"].items()}
        except (OSError, ValueError, TypeError, KeyError, IndexError, AttributeError):
            return {}  # missing, unreadable or corrupt: as if empty

    def _path(self, folder: str) -> Path:
        name = digest(f"{self.key}\0{folder}".encode("utf-8", "surrogateescape"))
        return self.directory / __version__ / f"{name}.json"

    def _prepare(self) -> None:
        """Create the cache directory, ignored by git and tagged as a cache for backups."""
        (self.directory / __version__).mkdir(parents=True, exist_ok=True)
        for name, text in (
            (".gitignore", "# Created by gaaudit.\n*\n"),
            (
                "CACHEDIR.TAG",
                "Signature: 8a477f597d28d172789f06886806bc55\n# Created by gaaudit.\n",
            ),
        ):
            if not (self.directory / name).exists():
                _write_atomic(self.directory / name, text)


def _write_atomic(path: Path, text: str) -> None:
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        temporary.write_text(text, encoding="utf-8")
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


def _encode(entry: Entry) -> list:
    findings = [
        [
            f.code,
            f.message,
            *_span(f.span),
            int(f.confidence),
            list(f.evidence),
            f.hint,
            f.fixable,
            f.cell,
        ]
        for f in entry.findings
    ]
    error = entry.error and [
        entry.error.message,
        entry.error.line,
        entry.error.column,
        entry.error.code,
    ]
    dependencies = [list(d) for d in entry.dependencies]
    notes = list(entry.notes)
    return [
        entry.signature,
        entry.digest,
        dependencies,
        findings,
        error,
        entry.hidden,
        notes,
        entry.fixable,
    ]


def _span(span: Span) -> tuple[int, int, int, int]:
    return (span.line, span.column, span.end_line, span.end_column)


def _decode(raw: list) -> Entry:
    """An entry from its JSON form; raises on anything malformed."""
    signed, content, dependencies, findings, error, hidden, notes, counted = raw
    decoded = tuple(
        Finding(
            "",
            str(code),
            str(message),
            Span(*map(int, span)),
            Confidence(confidence),
            tuple(map(str, evidence)),
            str(hint),
            bool(fixable),
            None if cell is None else int(cell),
        )
        for code, message, *span, confidence, evidence, hint, fixable, cell in findings
        if len(span) == 4
    )
    if len(decoded) != len(findings):
        raise ValueError("malformed finding")
    failure = (
        None
        if error is None
        else FileError("", str(error[0]), int(error[1]), int(error[2]), str(error[3]))
    )
    return Entry(
        _signature(signed),
        str(content),
        tuple((str(name), _signature(recorded)) for name, recorded in dependencies),
        decoded,
        failure,
        int(hidden),
        tuple(map(str, notes)),
        None if counted is None else int(counted),
    )


def _signature(raw) -> Signature | None:
    if raw is None:
        return None
    if not isinstance(raw, list) or len(raw) not in (0, 4):
        raise ValueError("malformed signature")
    return tuple(int(v) for v in raw)
