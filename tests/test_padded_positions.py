"""Padded positions: the audit counts every position as a token (calibration profiles,
donors, shuffles, variance shares, the loss), so data that marks some as padding (an
``attention_mask`` with zeros, a ``key_padding_mask`` with ones, in the inputs or a
Dataset's items) is refused in one line before anything is written, a mask that masks
nothing is fed to the model as given, and a tokenizer saved with padding or truncation
on encodes text whole (no pad id cut into windows, no text cut off)."""

from __future__ import annotations

import numpy as np
import pytest
import toys
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from torch import Tensor, nn

import fcaudit
from fcaudit import AuditData, AuditOptions
from fcaudit.core.errors import DataError
from fcaudit.io import selective_copy as sc
from fcaudit.io.data import DataSpec, Document, encode_documents, resolve_data

FAST = AuditOptions(objective="selective-copy", bootstrap=50, repeats=1, execution=False,
                    progress=False, batch_size=8, per_layer=False)


class MaskedToy(nn.Module):
    """The content toy taking a Hugging Face style dict: its logits are zeroed where the
    mask says padding (so a mask that masks nothing changes nothing)."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = toys.content_model()

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None,
                key_padding_mask: Tensor | None = None) -> Tensor:
        keep = attention_mask if attention_mask is not None else \
            (key_padding_mask == 0) if key_padding_mask is not None else None
        logits = self.inner(input_ids)
        return logits if keep is None else logits * keep[..., None].to(logits.dtype)


def _task(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    return sc.CopyTask(length=12, copies=2, data=8, noise=3).sample(np.random.default_rng(seed), n)


def _data(key: str, eval_mask: np.ndarray, calib_mask: np.ndarray,
          dataset: bool = False) -> AuditData:
    (x, y), (xc, _) = _task(16, 0), _task(8, 1)
    if dataset:
        items = [({"input_ids": x[i], key: eval_mask[i]}, y[i]) for i in range(len(x))]
        return AuditData(dataset=items, calib_inputs={"input_ids": xc, key: calib_mask})
    return AuditData(inputs={"input_ids": x, key: eval_mask}, targets=y,
                     calib_inputs={"input_ids": xc, key: calib_mask})


def _keep(n: int, padded: dict[int, int]) -> np.ndarray:
    """An attention mask ``[n, 12]`` of ones, row ``r`` padded on its last ``k`` positions."""
    mask = np.ones((n, 12), dtype=np.int64)
    for row, k in padded.items():
        mask[row, 12 - k:] = 0
    return mask


@pytest.mark.parametrize(("data", "fragment"), [
    (lambda: _data("attention_mask", _keep(16, {3: 2, 9: 5}), _keep(8, {})),
     "AuditData.inputs['attention_mask'] marks 7 of 192 positions as padding, in 2 of 16 "
     "examples"),
    (lambda: _data("key_padding_mask", _keep(16, {}) == 0, _keep(8, {0: 1}) == 0),
     "AuditData.calib_inputs['key_padding_mask'] marks 1 of 96 positions as padding, in 1 "
     "of 8 examples"),
    (lambda: _data("attention_mask", np.zeros((16, 12), dtype=np.int64), _keep(8, {})),
     "AuditData.inputs['attention_mask'] marks 192 of 192 positions as padding, in 16 of 16"),
    (lambda: _data("attention_mask", _keep(16, {15: 3}), _keep(8, {}), dataset=True),
     "AuditData.dataset's inputs['attention_mask'] marks 3 of 192 positions as padding, in "
     "1 of 16 examples"),
], ids=["attention mask", "padding mask of calibration", "everything masked", "a Dataset"])
def test_a_mask_that_pads_is_refused_before_anything(data, fragment, tmp_path) -> None:
    """The counts are the mask's zeros (ones of a padding mask) by hand; the line says
    what the audit would do with them and what to give instead, and nothing is written."""
    out = tmp_path / "out"
    with pytest.raises(DataError) as err:
        fcaudit.audit(MaskedToy(), out, sites=["inner.gates.*"], data=data(), options=FAST)
    message = str(err.value)
    assert fragment in message and "\n" not in message
    assert "counts every position as a token" in message and "without padding" in message
    assert not out.exists()


def test_a_mask_that_masks_nothing_is_fed_as_given() -> None:
    """All ones (a padding mask of all zeros): the audit runs on the model fed the mask,
    and every number equals the audit of the same ids without one."""
    (x, y), (xc, _) = _task(16, 0), _task(8, 1)
    plain = fcaudit.audit(MaskedToy(), sites=["inner.gates.*"], options=FAST,
                          data=AuditData(inputs={"input_ids": x}, targets=y,
                                         calib_inputs={"input_ids": xc}))
    masked = fcaudit.audit(MaskedToy(), sites=["inner.gates.*"], options=FAST,
                           data=_data("attention_mask", _keep(16, {}), _keep(8, {})))
    assert masked.data["inputs"]["attention_mask"] == [[12], "int64"]
    assert masked.metrics() == plain.metrics()


def _padding_tokenizer() -> Tokenizer:
    """Words a..f as ids 2..7 ([UNK] 0, [PAD] 1), saved with padding and truncation on."""
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(["a b c d e f"], trainers.WordLevelTrainer(
        special_tokens=["[UNK]", "[PAD]"]))
    tok.enable_padding(pad_id=1, pad_token="[PAD]")
    tok.enable_truncation(max_length=5)
    return tok


def test_a_tokenizer_saved_with_padding_encodes_each_document_whole(tmp_path) -> None:
    """Two documents of 2 and 7 words: their ids written out from the vocabulary (no pad
    id after the short one, nothing cut from the long one), and the windows cut from a
    folder of them are those ids' windows; the caller's tokenizer keeps its settings."""
    tok = _padding_tokenizer()
    vocab = tok.get_vocab()
    words = ["a b", "c d e f a b c"]
    ids = encode_documents(tok, [Document(str(i), w) for i, w in enumerate(words)])
    assert [list(x) for x in ids] == [[vocab[w] for w in doc.split()] for doc in words]
    assert tok.padding is not None and tok.truncation is not None
    folder = tmp_path / "text"
    folder.mkdir()
    for i, text in enumerate(words):
        (folder / f"{i}.txt").write_text(text, encoding="utf-8")
    data = resolve_data(tok, DataSpec(text=folder, seq_len=2, max_eval=None, max_calib=None),
                        2)
    pairs = [[vocab["a"], vocab["b"]], [vocab["c"], vocab["d"]], [vocab["e"], vocab["f"]],
             [vocab["a"], vocab["b"]]]  # 2 + 7 words: windows of 2, the 7th word left over
    assert sorted(map(list, [*data.eval_ids, *data.calib_ids])) == sorted(pairs)
    assert vocab["[PAD]"] not in {int(i) for i in [*data.eval_ids.ravel(),
                                                   *data.calib_ids.ravel()]}
