"""The pack cache on real files: one pack per model file whatever its name, a changed file's pack
rebuilt, the disk checked and the cap kept (least recently used packs evicted) before a build,
`tierflow cache list|rm|prune`, and the temporaries of builds killed midway (shown, removed, counted).

Each test has a cache folder of its own (TIERFLOW_CACHE in tmp_path) and small random models
(tests/support/make_model.py). The one fake is a full disk: shutil.disk_usage as cache.py calls it.
"""

import fcntl
import json
import logging
import os
import pty
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tests.support.budgets import streaming_budget
from tests.support.damage import flip_byte
from tests.support.make_model import write_model
from tests.support.model_spec import ModelSpec
from tests.support.packs import written_pack
from tierflow.cli.app import app
from tierflow.errors import BudgetError, InvalidArgumentError
from tierflow.offload.gguf.model_file import open_model_file
from tierflow.offload.pack import pack_cache as cache
from tierflow.offload.pack.pack_cache import pack_path, packs_folder
from tierflow.offload.pack.reader import PackedFile
from tierflow.offload.pack.writer import open_pack, pack_sizes
from tierflow.units import format_size

SPEC = ModelSpec(num_layers=2, hidden_size=128, ffn_size=256, num_heads=4, num_kv_heads=2)


pytestmark = pytest.mark.usefixtures("own_cache")


@pytest.fixture
def model(tmp_path) -> Path:
    return write_model(tmp_path / "model.gguf", SPEC)


def pack_of(model: Path) -> Path:
    """Opens the model's pack (building it if needed) and lets go of it."""
    return written_pack(model).path


def pack_bytes(model: Path) -> int:
    """The pack's extents as sized before a build (what the cap and disk checks compare)."""
    with open_model_file(model) as opened:
        return pack_sizes(opened).total_bytes


def seeded(tmp_path: Path, name: str, seed: int) -> Path:
    return write_model(tmp_path / name, ModelSpec(**{**SPEC.__dict__, "seed": seed}))


# -- one pack per file ------------------------------------------------------------------------


def _symlink(model: Path) -> Path:
    link = model.with_name("link.gguf")
    link.symlink_to(model)
    return link


def _hard_link(model: Path) -> Path:
    link = model.with_name("hard.gguf")
    os.link(model, link)
    return link


def _moved(model: Path) -> Path:
    elsewhere = model.parent / "elsewhere"
    elsewhere.mkdir()
    return model.rename(elsewhere / "renamed.gguf")


@pytest.mark.parametrize("other_name", [_symlink, _hard_link, _moved], ids=["symlink", "hard-link", "moved"])
def test_another_name_of_the_same_file_shares_its_pack(model, builds, other_name):
    first = pack_of(model)
    assert pack_of(other_name(model)) == first
    assert builds == [first]


def test_a_copy_of_a_file_gets_a_pack_of_its_own(model, builds):
    copy = Path(shutil.copy2(model, model.with_name("copy.gguf")))
    assert pack_of(copy) != pack_of(model)
    assert len(builds) == 2


def test_a_pack_left_on_an_inode_the_system_reused_is_replaced_by_one_named_after_the_new_file(
        model, tmp_path, builds):
    """A deleted model's inode given to a new file, as renaming the model and rewriting it shows
    the cache: another name, the same inode, another size or modification time."""
    left, inode, mtime_ns = pack_of(model), model.stat().st_ino, model.stat().st_mtime_ns
    new_file = model.rename(tmp_path / "new.gguf")
    write_model(new_file, ModelSpec(**{**SPEC.__dict__, "seed": 1}))
    os.utime(new_file, ns=(mtime_ns + 10**9, mtime_ns + 10**9))  # however coarse the clock
    assert new_file.stat().st_ino == inode
    assert pack_path(new_file).name.startswith("new.")
    assert pack_of(new_file) == pack_path(new_file) and not left.exists()
    assert builds == [left, pack_path(new_file)]


def test_a_file_rewritten_in_place_with_its_mtime_kept_gets_its_pack_rebuilt(model, tmp_path, builds):
    old = PackedFile(pack_of(model)).globals.crc32
    stat = model.stat()
    write_model(model, ModelSpec(**{**SPEC.__dict__, "seed": 1}))  # same size, other weights
    os.utime(model, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert (model.stat().st_size, model.stat().st_mtime_ns) == (stat.st_size, stat.st_mtime_ns)
    rebuilt = PackedFile(pack_of(model)).globals.crc32
    assert len(builds) == 2 and rebuilt != old
    assert rebuilt == PackedFile(pack_of(seeded(tmp_path, "fresh.gguf", 1))).globals.crc32


def test_an_edit_between_the_samples_that_keeps_size_and_mtime_gets_its_pack_rebuilt(model, builds):
    """Only the change time (which any write moves) tells: the whole file's CRC is checked then."""
    pack_of(model)
    stat = model.stat()
    flip_byte(model, stat.st_size // 8 * 7 - 4096)  # between the 3/4 and the last sample, in the weights
    os.utime(model, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert (model.stat().st_size, model.stat().st_mtime_ns) == (stat.st_size, stat.st_mtime_ns)
    pack_of(model)
    assert len(builds) == 2, "the edited file was served its old pack"


def test_a_moved_file_is_checked_once_and_keeps_its_pack(model, tmp_path, builds, monkeypatch):
    first = pack_of(model)
    moved = model.rename(tmp_path / "moved.gguf")  # its ctime moves, its bytes do not
    reads = []
    read = cache.content_crc
    monkeypatch.setattr(cache, "content_crc", lambda source: reads.append(source) or read(source))
    assert pack_of(moved) == first and pack_of(moved) == first
    assert builds == [first] and len(reads) == 1


# -- the disk and the cap, checked before a build ---------------------------------------------


def test_a_disk_without_room_for_the_pack_is_refused_before_writing(model, builds, monkeypatch):
    free = 10 << 20
    real = shutil.disk_usage(packs_folder())
    monkeypatch.setattr(cache.shutil, "disk_usage",
                        lambda path: real._replace(free=free))
    needed = pack_bytes(model) + cache.DISK_MARGIN_BYTES
    with pytest.raises(BudgetError) as refused:
        pack_of(model)
    message = str(refused.value)
    assert f"{format_size(free)} free" in message and f"needs {format_size(needed)}" in message
    assert str(packs_folder()) in message
    assert builds == [] and list(packs_folder().iterdir()) == []


def test_a_pack_larger_than_the_cap_is_refused_naming_both(model, builds, monkeypatch):
    nbytes = pack_bytes(model)
    monkeypatch.setenv(cache.CAP_VARIABLE, str(nbytes // 2))
    with pytest.raises(BudgetError) as refused:
        pack_of(model)
    assert format_size(nbytes) in str(refused.value) and format_size(nbytes // 2) in str(refused.value)
    assert builds == []


def test_the_cap_evicts_the_least_recently_used_pack(tmp_path, monkeypatch):
    models = [seeded(tmp_path, f"{name}.gguf", seed) for seed, name in enumerate("abc")]
    first = pack_of(models[0])
    monkeypatch.setenv(cache.CAP_VARIABLE, str(first.stat().st_size * 5 // 2))  # room for two
    second = pack_of(models[1])
    assert pack_of(models[0]) == first  # used again: now the second is the least recently used
    third = pack_of(models[2])
    assert first.exists() and third.exists() and not second.exists()


def test_a_pack_this_process_holds_open_is_never_evicted(tmp_path, monkeypatch):
    held_model, new_model = seeded(tmp_path, "held.gguf", 0), seeded(tmp_path, "new.gguf", 1)
    with open_model_file(held_model) as opened:
        held = open_pack(opened)
    monkeypatch.setenv(cache.CAP_VARIABLE, str(held.path.stat().st_size * 3 // 2))
    with pytest.raises(BudgetError, match=cache.CAP_VARIABLE):
        pack_of(new_model)
    assert held.path.exists()


# -- tierflow cache ---------------------------------------------------------------------------


def cli(*args: str):
    done = CliRunner().invoke(app, list(args))
    if done.exception is not None and not isinstance(done.exception, SystemExit):
        raise done.exception
    assert done.exit_code == 0, done.output
    return done


def listed() -> dict:
    return json.loads(cli("cache", "list", "--json").stdout)


def test_cache_list_shows_each_pack_with_its_model_file_and_the_total(tmp_path):
    models = [seeded(tmp_path, f"{name}.gguf", seed) for seed, name in enumerate("ab")]
    packs = [pack_of(model) for model in models]
    models[1].unlink()
    shown = listed()
    by_name = {pack["name"]: pack for pack in shown["packs"]}
    assert set(by_name) == {pack.name for pack in packs}
    assert [by_name[pack.name]["source"] for pack in packs] == [str(model.resolve()) for model in models]
    assert [by_name[pack.name]["source_exists"] for pack in packs] == [True, False]
    assert [by_name[pack.name]["bytes"] for pack in packs] == [pack.stat().st_size for pack in packs]
    assert shown["total_bytes"] == sum(pack.stat().st_size for pack in packs)


@pytest.mark.parametrize("naming", [lambda model, pack: str(model), lambda model, pack: pack.name,
                                    lambda model, pack: str(pack)],
                         ids=["model-file", "pack-name", "pack-path"])
def test_cache_rm_removes_the_pack_named_and_never_the_model(model, naming):
    pack = pack_of(model)
    cli("cache", "rm", naming(model, pack))
    assert not pack.exists() and model.exists()
    assert listed()["packs"] == []


def test_cache_rm_of_something_that_is_no_pack_is_a_clear_error(tmp_path):
    with pytest.raises(InvalidArgumentError, match="no pack named 'nothing.tfpack'"):
        cli("cache", "rm", "nothing.tfpack")


def test_cache_prune_removes_the_packs_whose_model_file_is_gone(tmp_path):
    kept, gone = seeded(tmp_path, "kept.gguf", 0), seeded(tmp_path, "gone.gguf", 1)
    kept_pack, gone_pack = pack_of(kept), pack_of(gone)
    gone.unlink()
    cli("cache", "prune")
    assert kept_pack.exists() and not gone_pack.exists()


def test_cache_prune_removes_the_records_of_packs_removed_by_hand(model):
    pack = pack_of(model)
    records = [pack.with_suffix(cache.USE_SUFFIX), pack.with_suffix(cache.ROUTING_SUFFIX)]
    for record in records:
        record.write_bytes(b"a record")
    pack.unlink()
    cli("cache", "prune")
    assert not any(record.exists() for record in records)


def test_cache_prune_removes_the_routings_an_older_tierflow_kept(model):
    pack = pack_of(model)
    retired = pack.with_suffix(".routing.npy")
    retired.write_bytes(b"a routing no tierflow reads now")
    cli("cache", "prune")
    assert pack.exists() and not retired.exists()


def test_cache_prune_max_size_keeps_the_most_recently_used_packs(tmp_path):
    models = [seeded(tmp_path, f"{name}.gguf", seed) for seed, name in enumerate("abc")]
    packs = [pack_of(model) for model in models]
    pack_of(models[0])  # the least recently used is now b
    cli("cache", "prune", "--max-size", str(packs[0].stat().st_size * 5 // 2))
    assert [pack.exists() for pack in packs] == [True, False, True]


def terminal_stderr(*args: str) -> str:
    """What `tierflow ARGS` shows on stderr when stderr is a terminal (a pseudo-terminal here)."""
    primary, secondary = pty.openpty()
    shown = bytearray()

    def drain() -> None:  # while the command runs: a full terminal buffer would block it
        while True:
            try:
                chunk = os.read(primary, 1 << 16)
            except OSError:  # EIO: the command's end closed the terminal
                return
            if not chunk:
                return
            shown.extend(chunk)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    try:
        done = subprocess.run([sys.executable, "-m", "tierflow.cli.app", *args], stdout=subprocess.PIPE,
                              stderr=secondary, timeout=120)
    finally:
        os.close(secondary)
    reader.join(timeout=60)  # the terminal closes with the command; a guard, not a wait
    os.close(primary)
    assert not reader.is_alive(), "the terminal stayed open after the command ended"
    assert done.returncode == 0, shown.decode(errors="replace")
    return shown.decode(errors="replace")


@pytest.mark.slow
def test_loading_on_a_terminal_names_the_new_pack_its_size_and_place(tmp_path):
    model = write_model(tmp_path / "model.gguf", ModelSpec(**{**SPEC.__dict__, "num_layers": 4}))
    streams = streaming_budget(model, 64, num_streamed=3, ring_slots=2)  # a resident load writes none
    shown = terminal_stderr("run", "Hello", "-m", str(model), "-n", "1", "--threads", "1", "--ctx", "64",
                            "--cpu-memory", str(streams))
    pack = pack_path(model)
    assert f"{format_size(pack_bytes(model))} into {pack}" in shown  # before the build
    assert f"packed model.gguf: {pack}, {format_size(pack.stat().st_size)}" in shown  # after it


# -- temporaries builds leave (issue 47) ------------------------------------------------------


def dead_pid() -> int:
    """The pid of a process that has ended (and been waited for)."""
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True)
    return int(done.stdout)


# A child that builds the model's pack in its main thread and stops, its temporary half written, once
# the globals are in it: the parent then kills it.
PAUSED_BUILD = """
import sys, time
from pathlib import Path
from tierflow.offload.gguf.model_file import open_model_file
from tierflow.offload.pack import writer

original = writer.extents

def paused(model, decoder=None, **kwargs):
    for index, item in enumerate(original(model, decoder, **kwargs)):
        if index == 1 and decoder is not None:
            print("building", flush=True)
            time.sleep(120)
        yield item

writer.extents = paused
with open_model_file(Path(sys.argv[1])) as opened:
    writer.open_pack(opened)
"""


def killed_midway(model: Path, signum: int) -> tuple[int, int]:
    """Builds the model's pack in a child killed by `signum` midway: (its pid, its exit code)."""
    child = subprocess.Popen([sys.executable, "-c", PAUSED_BUILD, str(model)], stdout=subprocess.PIPE,
                             text=True)
    try:
        assert child.stdout.readline() == "building\n"
        temporary = pack_path(model).with_name(f"{pack_path(model).name}.{child.pid}.tmp")
        assert temporary.stat().st_size > 0  # half written
        child.send_signal(signum)
        return child.pid, child.wait(timeout=60)
    finally:
        child.kill()
        child.wait()


@pytest.mark.slow
def test_a_build_killed_midway_leaves_a_temporary_that_cache_list_shows_and_prune_removes(model):
    pid, code = killed_midway(model, signal.SIGKILL)
    assert code == -signal.SIGKILL
    temporary = packs_folder() / f"{pack_path(model).name}.{pid}.tmp"
    size = temporary.stat().st_size
    shown = listed()
    assert shown["packs"] == [] and shown["stale_bytes"] == size
    assert shown["stale_temporaries"] == [{"name": temporary.name, "path": str(temporary), "bytes": size,
                                           "pid": pid}]
    table = " ".join(cli("cache", "list").stdout.split())  # the caption as one line, however wrapped
    assert f"{format_size(size)} in 1 temporary file(s) left by builds that were killed" in table
    assert "tierflow cache prune removes them" in table
    pruned = " ".join(cli("cache", "prune").stdout.split())
    assert not temporary.exists()
    assert f"removed {temporary.name} ({format_size(size)}, left by process {pid}" in pruned
    assert f"freed {format_size(size)}" in pruned
    assert listed()["stale_temporaries"] == []


@pytest.mark.slow
def test_sigterm_during_a_build_removes_its_temporary(model):
    pid, code = killed_midway(model, signal.SIGTERM)
    assert code == -signal.SIGTERM  # it still dies of the signal, as without the handler
    assert list(packs_folder().glob("*.tmp")) == [] and not pack_path(model).exists()


def test_a_build_removes_the_temporaries_killed_builds_left_before_its_disk_check(model, monkeypatch, caplog):
    stale = packs_folder() / f"other.0123456789abcdef.tfpack.{dead_pid()}.tmp"
    stale.write_bytes(bytes(3 << 20))
    needed = pack_bytes(model) + cache.DISK_MARGIN_BYTES
    real = shutil.disk_usage(packs_folder())
    # room for the pack only with the temporary's bytes: refused unless it is removed before the check
    monkeypatch.setattr(cache.shutil, "disk_usage", lambda path: real._replace(
        free=needed - 1 + (0 if stale.exists() else 3 << 20)))
    with caplog.at_level(logging.INFO, logger="tierflow.offload.pack"):
        assert pack_of(model).exists()
    assert not stale.exists()
    assert f"removed 1 temporary ({format_size(3 << 20)})" in caplog.text and stale.name in caplog.text


def test_temporaries_of_writers_still_alive_are_kept(model):
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    folder = packs_folder()
    try:
        live = folder / f"live.tfpack.{sleeper.pid}.tmp"
        live.write_bytes(b"being written")
        # a writer whose pid means nothing here (another container's, another host's) holds its lock
        elsewhere = folder / f"elsewhere.tfpack.{dead_pid()}.tmp"
        with open(elsewhere, "wb") as held:
            fcntl.flock(held.fileno(), fcntl.LOCK_EX)
            assert listed()["stale_temporaries"] == []
            cli("cache", "prune")
            pack_of(model)  # a build's cleanup before its disk check
            assert live.exists() and elsewhere.exists()
        assert [stale["name"] for stale in listed()["stale_temporaries"]] == [elsewhere.name]  # let go
    finally:
        sleeper.kill()
        sleeper.wait()
    stale = sorted(temporary["name"] for temporary in listed()["stale_temporaries"])
    assert stale == sorted([live.name, elsewhere.name])


def test_cache_prune_removes_the_scratch_file_a_killed_probe_left(own_cache):
    scratch = own_cache / f".tierflow-probe.{dead_pid()}.tmp"
    scratch.write_bytes(bytes(1 << 20))
    assert [stale["name"] for stale in listed()["stale_temporaries"]] == [scratch.name]
    pruned = " ".join(cli("cache", "prune").stdout.split())
    assert not scratch.exists() and f"removed {scratch.name} ({format_size(1 << 20)}" in pruned
