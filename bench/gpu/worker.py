"""A GPU worker for the acceptance check: holds memory, reports where it lives, can leak cuBLAS workspaces.

Payload actions: "where" (device and memory as the worker sees them), "hold" (allocate N GiB and keep it),
"graph" (capture and replay a CUDA graph on a fresh side stream: the pattern that leaks a cuBLAS
workspace per request), "sleep" (stay busy).
"""

import importlib.util
import os
import sys
import time

import torch


def main():
    spec = importlib.util.spec_from_file_location("worker_base", os.environ["RESIDENT_POOL_WORKER_BASE"])
    worker_base = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(worker_base)
    torch.cuda.init()
    held = []
    weight = torch.randn(1024, 1024, device="cuda")

    def on_predict(payload):
        action = payload.get("action")
        if action == "where":
            free, total = torch.cuda.mem_get_info()
            props = torch.cuda.get_device_properties(0)
            return {"visible": os.environ.get("CUDA_VISIBLE_DEVICES"), "free": free, "total": total,
                    "name": props.name, "pci_bus_id": getattr(props, "pci_bus_id", None), "pid": os.getpid()}
        if action == "hold":
            held.append(torch.empty(int(payload["gib"] * 2**30), dtype=torch.uint8, device="cuda"))
            torch.cuda.synchronize()
            return {"allocated": torch.cuda.memory_allocated(), "pid": os.getpid()}
        if action == "graph":
            before = torch.cuda.memory_allocated()  # after the previous request's release, if any
            side = torch.cuda.Stream()  # a new stream per request, as graph-capturing models do
            x = torch.randn(512, 1024, device="cuda")
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):
                    x @ weight  # warm-up on the side stream: cuBLAS makes this stream's workspace here
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=side):
                y = x @ weight
            graph.replay()
            torch.cuda.synchronize()
            del graph, y
            return {"allocated_before": before}
        if action == "sleep":
            time.sleep(float(payload["seconds"]))
            return {"slept": payload["seconds"]}
        raise ValueError(f"unknown action {action!r}")

    worker_base.serve(slug=os.environ.get("GPU_CHECK_SLUG", "gpu-check"), socket_path=sys.argv[1],
                      on_predict=on_predict)


if __name__ == "__main__":
    main()
