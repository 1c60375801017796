"""The minilm demo as it was before issue 33: each input fed to the sentence model as one word.

The tokenizer turns any word over 100 characters into a single [UNK], so most
proteins are read as `[CLS] [UNK] [SEP]` and share one embedding. Kept as a
fixture: `resident-pool check --smoke` must fail it. It reports what it read
honestly ("tokens" with [CLS] and [SEP], "unknown_tokens"), as the fixed demo does.
"""

import importlib.util
import os
import sys

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def load(weights_root):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(weights_root, device="cpu")


def main():
    spec = importlib.util.spec_from_file_location("worker_base", os.environ["RESIDENT_POOL_WORKER_BASE"])
    worker_base = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(worker_base)
    staged = worker_base.staged()
    model = staged if staged is not None else load(sys.argv[2])
    unknown = model.tokenizer.unk_token_id

    def on_predict(payload):
        inputs = payload["inputs"]
        ids = model.tokenizer(inputs, add_special_tokens=True)["input_ids"]
        vectors = model.encode(inputs, normalize_embeddings=True)
        return {"items": [{"embedding": [round(float(x), 5) for x in vector], "tokens": len(row),
                           "unknown_tokens": row.count(unknown)} for vector, row in zip(vectors, ids, strict=True)]}

    worker_base.serve(slug="minilm", socket_path=sys.argv[1], on_predict=on_predict)


if __name__ == "__main__":
    main()
