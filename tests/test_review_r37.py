"""Review r37 (issue 32's suite changes, fe27a34..1c381bd): what the speed-ups may have hidden.

fe27a34 ignores Hypothesis's "Do not use the `random` module inside strategies" in pyproject's filterwarnings (a
Prefect background thread drawing from `random` meanwhile made a property test fail as flaky). The ignore holds for
every test, so a strategy of ours that draws from the random module (examples then neither reproducible nor
shrinkable) no longer fails anything; the comment says review would catch it. A reading of the code catches it here.
"""

from __future__ import annotations

import ast
import random
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.errors import HypothesisDeprecationWarning

TESTS = Path(__file__).parent
# Calls of the random module's own functions that no strategy makes: a thread of the test that proves the ignore.
ALLOWED = {("test_golden.py", "draw")}


@settings(max_examples=5, database=None)
@given(st.integers().map(lambda n: n + random.random()))  # the misuse: a strategy drawing from the random module
def _a_strategy_that_draws_from_the_random_module(value):
    assert value == value


@pytest.mark.xfail(strict=True, raises=pytest.fail.Exception,
                   reason="pyproject.toml ignores the warning for every test (fe27a34): the misuse passes silently; "
                          "test_r37_no_strategy_of_ours_draws_from_the_random_module catches it instead")
def test_r37_a_strategy_that_draws_from_the_random_module_fails_its_test():
    with pytest.raises(HypothesisDeprecationWarning):
        _a_strategy_that_draws_from_the_random_module()


def _global_random_calls(source: str, name: str) -> list[str]:
    """Where a file that uses Hypothesis calls a function of the random module itself (random.random(),
    random.choice(), ...; random.Random(seed) is a generator of its own and fine): 'file:function:line'."""
    tree = ast.parse(source)
    if not any(isinstance(node, (ast.Import, ast.ImportFrom)) and "hypothesis" in ast.unparse(node)
               for node in ast.walk(tree)):
        return []
    found = []

    def visit(node: ast.AST, function: str) -> None:
        for child in ast.iter_child_nodes(node):
            inner = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else function
            if (isinstance(child, ast.Call) and isinstance(child.func, ast.Attribute)
                    and isinstance(child.func.value, ast.Name) and child.func.value.id == "random"
                    and child.func.attr not in ("Random", "SystemRandom")
                    and (name, function) not in ALLOWED):
                found.append(f"{name}:{function}:{child.lineno}")
            visit(child, inner)

    visit(tree, "<module>")
    return found


def test_r37_no_strategy_of_ours_draws_from_the_random_module():
    """The check the ignored warning no longer makes, by reading: no test file that uses Hypothesis calls the random
    module's own functions, but the one thread that proves the ignore (test_golden.py's `draw`)."""
    planted = "import random\nfrom hypothesis import strategies as st\nS = st.integers().map(lambda n: random.random())\n"
    assert _global_random_calls(planted, "planted.py") == ["planted.py:<module>:3"]  # the check finds a misuse
    found = [hit for path in sorted(TESTS.glob("*.py")) if path.name != Path(__file__).name
             for hit in _global_random_calls(path.read_text(), path.name)]
    assert not found, f"the random module drawn from where Hypothesis runs (use st.randoms() or a seeded Random): {found}"


# -- ad11bac's shared REST helper (tests/helpers.py rest_call / rest_answer), against a server that misbehaves -----


@pytest.fixture
def answering():
    """A loopback HTTP server answering each request with the next of ``script`` (status, body); the last repeats."""
    import http.server
    import threading

    script: list[tuple[int, bytes]] = []
    seen: list[str] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def _answer(self) -> None:
            seen.append(self.command)
            status, body = script.pop(0) if len(script) > 1 else script[0]
            self.send_response(status)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_POST = _answer

        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/api", script, seen
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def test_r37_a_4xx_whose_body_is_not_json_is_told_in_the_servers_own_words(answering):
    from helpers import rest_answer, rest_call

    url, script, _ = answering
    script.append((409, b"<html>conflict: parameter 'provider' is required</html>"))
    assert rest_call(url, "POST", "/x", {}) == (409, "<html>conflict: parameter 'provider' is required</html>")
    with pytest.raises(AssertionError, match=r"POST /x: 409 <html>conflict: parameter 'provider'"):
        rest_answer(url, "POST", "/x", {})


def test_r37_a_503_is_asked_again_with_the_same_body_until_it_answers(answering):
    from helpers import rest_answer

    url, script, seen = answering
    script.extend([(503, b"busy"), (503, b"busy"), (201, b'{"id": "run"}')])
    assert rest_answer(url, "POST", "/deployments/d/create_flow_run", {"parameters": {}}) == {"id": "run"}
    assert seen == ["POST", "POST", "POST"]
