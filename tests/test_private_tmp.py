"""Runs of verl's trainer side by side get a /tmp of their own (the CPU harness): verl names the ZMQ socket of its
colocated weight transfer ``/tmp/rl-colocate-zmq-{ray job id}-replica-{r}-rank-{k}.sock`` and every fresh Ray
cluster's first job id is the same, so two runs sharing /tmp can bind one socket."""

import os
import pathlib
import shutil
import subprocess
import uuid

import pytest

from verl_mtp_cpu import harness


def test_verls_weight_transfer_socket_is_named_after_the_ray_job_id():
    """What makes the private /tmp necessary, read from the installed verl (the trainer and the vLLM side)."""
    import inspect

    from verl.workers.rollout.vllm_rollout import utils, vllm_rollout

    assert "rl-colocate-zmq-{job_id}" in inspect.getsource(vllm_rollout)
    assert "rl-colocate-zmq-{job_id}" in inspect.getsource(utils)


def test_runs_side_by_side_each_get_their_own_tmp_and_share_the_kept_folders(tmp_path):
    if harness.private_tmp_prefix() is None:
        # no mount namespace here: the harness never runs two of verl's trainers at once
        assert harness.runs_side_by_side(reserve_gib=-1000) == 1
        with pytest.raises(harness.RecipeRunError, match="unshare"):
            harness._with_private_tmp(["true"], tmp_path)
        return
    keep = tmp_path / "run"  # pytest's tmp_path lies under /tmp: there before the run, so bound back
    keep.mkdir()
    (keep / "in.txt").write_text("from the harness")
    sock = "/tmp/rl-colocate-zmq-01000000-replica-0-rank-0.sock"
    pathlib.Path(sock).unlink(missing_ok=True)
    script = (f"cat {keep}/in.txt > {keep}/$0.txt; test ! -e {sock}; echo $0 > {sock}; sleep 1; "
              f"test \"$(cat {sock})\" = \"$0\"")
    prog = keep / "prog.sh"  # a program under /tmp (a checkout or venv there) runs inside the namespace too
    prog.write_text("#!/bin/sh\n" + script.replace("$0", "$1") + "\n")
    prog.chmod(0o755)
    procs, origs = [], []
    for name in ("a", "b"):
        orig = harness._outside_tmp_dir()  # the real /tmp's mount point in the namespace
        origs.append(orig)
        cmd = harness._with_private_tmp([str(prog), name], orig)
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    for p in procs:
        out, _ = p.communicate(timeout=60)
        assert p.returncode == 0, out  # each saw no socket of the other and kept its own
    assert (keep / "a.txt").read_text() == (keep / "b.txt").read_text() == "from the harness"
    assert not pathlib.Path(sock).exists()  # nothing reached the real /tmp
    for orig in origs:
        orig.rmdir()  # empty again once the namespace is gone
    with pytest.raises(ValueError, match="outside /tmp"):
        harness._with_private_tmp(["true"], tmp_path)


def test_an_entry_removed_while_the_run_starts_is_left_out_and_one_that_cannot_be_bound_stops_it(tmp_path):
    """Another process may remove a /tmp entry between the run's listing of /tmp and its bind (a library's
    temporary folder): that entry is left out. A ``mount`` in front of the real one makes it happen every time: it
    removes a ``vanishing-*`` source before binding it and fails a ``stuck-*`` one that is still there."""
    if harness.private_tmp_prefix() is None:
        with pytest.raises(harness.RecipeRunError, match="unshare"):
            harness._with_private_tmp(["true"], tmp_path)
        return
    shim = tmp_path / "bin"
    shim.mkdir()
    (shim / "mount").write_text(
        "#!/bin/sh\n"
        'if [ "$1" = "--bind" ]; then case "${2##*/}" in vanishing-*) rm -rf "$2";; stuck-*) exit 1;; esac; fi\n'
        f'exec {shutil.which("mount")} "$@"\n')
    (shim / "mount").chmod(0o755)
    env = {**os.environ, "PATH": f"{shim}{os.pathsep}{os.environ['PATH']}"}
    tag = uuid.uuid4().hex[:8]
    gone, gone_file = pathlib.Path(f"/tmp/vanishing-{tag}"), pathlib.Path(f"/tmp/vanishing-{tag}.txt")
    stuck = pathlib.Path(f"/tmp/stuck-{tag}")
    (tmp_path / "in.txt").write_text("kept")
    try:
        gone.mkdir()
        gone_file.write_text("x")
        orig = harness._outside_tmp_dir()
        run = subprocess.run(harness._with_private_tmp(
            ["sh", "-c", f"test ! -e {gone} && test ! -e {gone_file} && cat {tmp_path}/in.txt"], orig),
            env=env, capture_output=True, text=True, timeout=60)
        assert (run.returncode, run.stdout) == (0, "kept"), run.stderr  # the rest of /tmp still bound back
        assert not gone.exists() and not gone_file.exists()
        orig.rmdir()
        stuck.mkdir()
        orig = harness._outside_tmp_dir()
        run = subprocess.run(harness._with_private_tmp(["true"], orig), env=env, capture_output=True, text=True,
                             timeout=60)
        assert run.returncode != 0  # there, and not bound: the run does not start without it
        orig.rmdir()
    finally:
        for path in (gone, stuck):
            shutil.rmtree(path, ignore_errors=True)
        gone_file.unlink(missing_ok=True)
