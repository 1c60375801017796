from __future__ import annotations

import os
import stat

import pytest
from helpers import state_dir, worker_command

from resident_pool import StateDirError
from resident_pool.errors import SocketPathTooLong


def test_state_dir_is_created_0700(isolated_dirs):
    path = state_dir()
    assert str(path) == isolated_dirs["state"]
    assert stat.S_IMODE(path.stat().st_mode) == 0o700


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o705])
def test_a_state_dir_open_to_others_is_refused_with_the_fix(isolated_dirs, mode):
    path = state_dir()
    os.chmod(path, mode)
    with pytest.raises(StateDirError) as info:
        state_dir()
    assert str(path) in str(info.value) and f"{mode:04o}" in str(info.value)
    assert "chmod 700" in str(info.value)


def test_a_state_dir_owned_by_another_user_is_refused(isolated_dirs):
    path = state_dir()
    os.chown(path, 65534, -1)
    with pytest.raises(StateDirError, match="owned by uid 65534"):
        state_dir()


def test_a_symlinked_state_dir_is_refused(tmp_path, monkeypatch):
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(real)
    monkeypatch.setenv("RESIDENT_POOL_STATE_DIR", str(tmp_path / "link"))
    with pytest.raises(StateDirError, match="not a plain directory"):
        state_dir()


def test_worker_socket_is_0600_and_an_over_long_path_is_a_clear_error(workers, tmp_path, monkeypatch):
    worker = workers(build_command=worker_command())
    worker.ensure_started()
    assert stat.S_IMODE(os.stat(worker.socket_path).st_mode) == 0o600

    deep = tmp_path / ("d" * 100)
    monkeypatch.setenv("RESIDENT_POOL_STATE_DIR", str(deep))
    too_long = workers(slug="long", build_command=worker_command())
    with pytest.raises(ValueError, match="AF_UNIX limit") as info:
        too_long.ensure_started()
    assert str(deep) in str(info.value) and isinstance(info.value, SocketPathTooLong)
