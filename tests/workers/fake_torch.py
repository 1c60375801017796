"""Copied beside a worker as torch.py: a stand-in whose CUDA says it is initialized once $FAKE_TORCH_CUDA_FLAG exists."""

import os


class cuda:  # lowercase: the attribute path torch has, torch.cuda.is_initialized()
    @staticmethod
    def is_initialized():
        return os.path.exists(os.environ["FAKE_TORCH_CUDA_FLAG"])
