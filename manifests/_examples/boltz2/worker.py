"""Sketch of a Boltz-2 worker: build the model once, then serve predictions.

Not run by the tests (no GPU, no Boltz here); it shows the shape of a GPU worker.
"""

import argparse
import importlib.util
import os


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--socket", required=True)
    parser.add_argument("--cache", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    spec = importlib.util.spec_from_file_location("worker_base", os.environ["RESIDENT_POOL_WORKER_BASE"])
    worker_base = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(worker_base)

    from boltz.main import load_model  # the model's own stack, present only in its environment

    model = load_model(cache=args.cache, device="cuda")

    def on_predict(payload):
        return model.predict(payload, out_dir=args.out)

    worker_base.serve(slug="boltz2", socket_path=args.socket, on_predict=on_predict)


if __name__ == "__main__":
    main()
