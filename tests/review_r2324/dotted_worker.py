"""A worker written to the original design that loads the base under its package's dotted name."""
import importlib.util
import os
import sys

spec = importlib.util.spec_from_file_location("tooluniverse.remote_resident.worker_base",
                                              os.environ["TOOLUNIVERSE_REMOTE_WORKER_BASE"])
wb = importlib.util.module_from_spec(spec)
spec.loader.exec_module(wb)
P = wb.protocol()


def on_predict(req):
    return {"reversed": req["sequence"][::-1], "ping_op": P.OP_PING}


wb.serve(slug="dotted", socket_path=sys.argv[1], on_predict=on_predict)
