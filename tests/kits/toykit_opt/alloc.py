def env_row():
    return {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
