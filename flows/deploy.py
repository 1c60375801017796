"""Register the three flows as deployments on a process work pool.

    python flows/deploy.py [--work-pool resident-pool] [--manifests DIR]

Run a worker for that pool (`prefect worker start --pool resident-pool`) on each
GPU host; every flow run then reaches that host's resident pool.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from prefect import flow
from prefect.client.orchestration import get_client
from prefect.exceptions import ObjectAlreadyExists

ROOT = Path(__file__).resolve().parents[1]
FLOWS = {
    "screen": "flows/screen.py:screen",
    "validate": "flows/validate.py:validate",
    "predict": "flows/predict.py:predict",
}


def ensure_work_pool(name: str) -> None:
    with get_client(sync_client=True) as client:
        from prefect.client.schemas.actions import WorkPoolCreate

        try:
            client.create_work_pool(WorkPoolCreate(name=name, type="process"))
        except ObjectAlreadyExists:
            pass  # registering again is fine


def deploy_all(work_pool: str, manifests: str | None = None, tags: list[str] | None = None) -> list[str]:
    ensure_work_pool(work_pool)
    ids = []
    for name, entrypoint in FLOWS.items():
        remote = flow.from_source(source=str(ROOT), entrypoint=entrypoint)
        parameters = {"manifests": manifests} if manifests else {}
        ids.append(str(remote.deploy(name=name, work_pool_name=work_pool, parameters=parameters,
                                     tags=tags or ["resident-pool"], print_next_steps=False)))
    return ids


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work-pool", default="resident-pool")
    parser.add_argument("--manifests", default=str(ROOT / "manifests"))
    arguments = parser.parse_args()
    for deployment_id in deploy_all(arguments.work_pool, arguments.manifests):
        print(deployment_id)
