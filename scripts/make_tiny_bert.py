"""Write the tiny text model the tests and the README's text walk-through use, and export
sentence embedders to ONNX as sentence-transformers users do (benchmarks/transformers.py).

* ``tiny_bert.tokenizer.json``: a WordPiece tokenizer in the Hugging Face ``tokenizers``
  format (BERT normalizer, pre-tokenizer and [CLS]/[SEP] post-processor), its vocabulary
  learned from the real sentences of ``tests/sentences.py``;
* ``tiny_bert.onnx``: a BERT encoder from a small ``BertConfig`` (2 layers, hidden 64,
  random weights, seed 0) wrapped as a sentence embedder: inputs ``input_ids``,
  ``attention_mask`` and ``token_type_ids`` int64 [batch, sequence], outputs the two first
  inputs passed through (int64), ``token_embeddings`` [b, s, 64] and the L2-normalized
  mean-pooled ``sentence_embedding`` [b, 64]. Batch and sequence stay dynamic.

Run:  pip install -e ".[train]" && python scripts/make_tiny_bert.py
No network: the tokenizer is trained here and the model is built from a config.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "pipeline" / "assets"
sys.path.insert(0, str(ROOT / "tests"))

OPSET = 17
IR_VERSION = 8  # what ONNX Runtime and OpenVINO load (docs: findings)


def train_tokenizer(texts, vocab_size: int):
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    special = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tokenizer.train_from_iterator(texts, trainers.WordPieceTrainer(vocab_size=vocab_size, special_tokens=special))
    cls, sep = tokenizer.token_to_id("[CLS]"), tokenizer.token_to_id("[SEP]")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", cls), ("[SEP]", sep)])
    return tokenizer


class SentenceEmbedder:
    """A BERT model as sentence-transformers exports it: token embeddings, mean pooling over
    the attention mask, L2 normalization; the int64 inputs passed through as outputs."""

    @staticmethod
    def module(bert, token_type_ids: bool):
        import torch

        class Embedder(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.bert = bert

            def forward(self, input_ids, attention_mask, *rest):
                kwargs = {"token_type_ids": rest[0]} if token_type_ids else {}
                tokens = self.bert(input_ids=input_ids, attention_mask=attention_mask, **kwargs).last_hidden_state
                mask = attention_mask.unsqueeze(-1).to(tokens.dtype)
                pooled = (tokens * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
                embedding = torch.nn.functional.normalize(pooled, p=2, dim=1)
                return input_ids * 1, attention_mask * 1, tokens, embedding

        return Embedder().eval()


def export(bert, path: Path, token_type_ids: bool = True) -> Path:
    """The embedder of ``bert`` as ONNX at ``path`` (batch and sequence dynamic)."""
    import onnx
    import torch

    inputs = ["input_ids", "attention_mask"] + (["token_type_ids"] if token_type_ids else [])
    outputs = ["input_ids_out", "attention_mask_out", "token_embeddings", "sentence_embedding"]
    example = tuple(torch.ones(1, 8, dtype=torch.int64) for _ in inputs)
    dims = {name: {0: "batch", 1: "sequence"} for name in inputs}
    dims.update({"input_ids_out": {0: "batch", 1: "sequence"}, "attention_mask_out": {0: "batch", 1: "sequence"},
                 "token_embeddings": {0: "batch", 1: "sequence"}, "sentence_embedding": {0: "batch"}})
    torch.onnx.export(SentenceEmbedder.module(bert, token_type_ids), example, str(path), input_names=inputs,
                      output_names=outputs, dynamic_axes=dims, opset_version=OPSET, dynamo=False)
    model = onnx.load(str(path))
    model.ir_version = IR_VERSION
    onnx.save(model, str(path))
    return path


def tiny_bert(vocab_size: int):
    import torch
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    config = BertConfig(vocab_size=vocab_size, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=128, max_position_embeddings=128,
                        attn_implementation="eager")
    return BertModel(config, add_pooling_layer=False).eval()


def main() -> None:
    import sentences

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--vocab", type=int, default=2000)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(sentences.sentences(), args.vocab)
    tokenizer.save(str(args.out / "tiny_bert.tokenizer.json"))
    export(tiny_bert(tokenizer.get_vocab_size()), args.out / "tiny_bert.onnx")
    check(args.out)


def check(folder: Path) -> None:
    """ONNX Runtime runs the file on a real sentence and gives a unit embedding."""
    import numpy as np
    import onnxruntime as ort
    from tokenizers import Tokenizer

    encoding = Tokenizer.from_file(str(folder / "tiny_bert.tokenizer.json")).encode("The model is verified.")
    feeds = {"input_ids": np.array([encoding.ids]), "attention_mask": np.array([encoding.attention_mask]),
             "token_type_ids": np.array([encoding.type_ids])}
    session = ort.InferenceSession(str(folder / "tiny_bert.onnx"), providers=["CPUExecutionProvider"])
    outputs = session.run(None, feeds)
    norm = float(np.linalg.norm(outputs[3]))
    assert abs(norm - 1) < 1e-4 and np.array_equal(outputs[0], feeds["input_ids"]), (norm, outputs[0])
    print(f"wrote {folder}/tiny_bert.onnx and tiny_bert.tokenizer.json: {encoding.tokens}, |embedding| = {norm:.4f}")


if __name__ == "__main__":
    main()
