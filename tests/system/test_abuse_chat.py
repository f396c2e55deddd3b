"""Issue 27 against `lmcli chat` and `train --task sft`: hostile templates and hostile input.

Rows: 2 (a chat template runs unbounded: chat and SFT hang, train ignores SIGINT, a gigabyte
string; the sandbox must keep holding), 5 (`chat --json` input unbounded, dropping old turns
quadratic), 6 (`/save` replaces a FIFO or a device), 8 (a raw byte or a lone surrogate on
`chat --json`'s stdin, in SFT rows), and the minor ones (SFT rows with invalid UTF-8, a SIGTERM
while a run opens leaving a folder that holds only `.lock`). Commands that hung before run in a
process of their own, with a timeout.
"""

from __future__ import annotations

import io
import json
import os
import resource
import shutil
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from helpers import FAST_TRAIN_ARGS, assert_one_line_error, make_run, run_cli

from lmcli.cli.chat import read_messages
from lmcli.config.commands import SampleConfig
from lmcli.errors import LmcliError
from lmcli.formats.sources import load_model
from lmcli.generate.chat import ChatSession
from lmcli.text.template_render import Renderer, RenderLimits, Template, cpu_seconds

LOOPS = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
HI = json.dumps({"messages": [{"role": "user", "content": "the cat"}]})


LAUNCH = (  # lmcli, then its peak RSS (VmHWM) on stderr's last line
    "import atexit, runpy, sys\n"
    "def peak():\n"
    "    hwm = next(l for l in open('/proc/self/status') if l.startswith('VmHWM'))\n"
    "    print('peak-rss-kb', hwm.split()[1], file=sys.stderr)\n"
    "atexit.register(peak)\n"
    "sys.argv = ['lmcli', *sys.argv[1:]]\n"
    "runpy.run_module('lmcli', run_name='__main__')\n"
)


def lmcli(
    *argv: str, stdin: str | bytes = "", timeout: float = 60
) -> tuple[subprocess.CompletedProcess, float, float]:
    """``lmcli ARGV`` in its own process: the result, its seconds and its peak RSS in MiB."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    data = stdin.encode() if isinstance(stdin, str) else stdin
    start = time.perf_counter()
    result = subprocess.run(
        [sys.executable, "-c", LAUNCH, *argv], input=data, capture_output=True, env=env, timeout=timeout
    )
    seconds = time.perf_counter() - start
    peak = [ln for ln in result.stderr.decode(errors="replace").splitlines() if ln.startswith("peak-rss-kb")]
    return result, seconds, int(peak[-1].split()[1]) / 1024 if peak else 0.0


def one_line(result: subprocess.CompletedProcess, message: str) -> None:
    err = result.stderr.decode(errors="replace")
    lines = [ln for ln in err.splitlines() if ln.strip() and not ln.startswith(("warning:", "peak-rss-kb"))]
    assert result.returncode == 2 and len(lines) == 1 and message in lines[0], err


@pytest.fixture(scope="module")
def looping(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run whose folder's chat template loops 10^10 times."""
    run = make_run(tmp_path_factory.mktemp("loops") / "run", block_size=64)
    for name in ("last", "best"):
        (run / name / "chat_template.jinja").write_text(LOOPS)
    return run


@pytest.fixture(scope="module")
def chat_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_run(tmp_path_factory.mktemp("chat") / "run", block_size=64)


# ----------------------------------------------------------------------------- 2: templates
@pytest.mark.slow
def test_chat_json_with_a_looping_template_exits_2_within_its_budget(looping: Path) -> None:
    """Row 2: it hung; now one line naming the folder, once the 2 s budget has passed."""
    result, _, _ = lmcli("chat", str(looping), "--json", "--device", "cpu", stdin=HI)
    one_line(result, f"the chat template of {looping / 'best'} did not render within 2 s")
    session = ChatSession.from_checkpoint(load_model(looping), SampleConfig(max_new_tokens=4))
    start, cpu = time.perf_counter(), resource.getrusage(resource.RUSAGE_CHILDREN)
    with pytest.raises(LmcliError, match="did not render within 2 s of CPU time"):
        session.say("the cat")
    session.close()
    # the budget is the worker's CPU time (its start included), whatever else loads the machine
    spent = resource.getrusage(resource.RUSAGE_CHILDREN)
    assert 2.0 <= spent.ru_utime + spent.ru_stime - cpu.ru_utime - cpu.ru_stime < 3.0
    assert time.perf_counter() - start < RenderLimits().wall_seconds


def workers(parent: int | None = None) -> list[int]:
    """The live template workers of process ``parent`` (default: this one), by /proc."""
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            state, ppid = (proc / "stat").read_bytes().rpartition(b")")[2].split()[:2]
            mine = int(ppid) == (parent or os.getpid()) and state != b"Z"
            if mine and b"template_worker" in (proc / "cmdline").read_bytes():
                found.append(int(proc.name))
        except (OSError, ValueError, IndexError):
            pass
    return found


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="no /proc: the wall clock limits renders")
def test_the_render_limit_is_cpu_time_so_a_loaded_machine_refuses_no_template() -> None:
    """Issue 48, finding 10: the limit was the wall clock, so a machine busy with other work
    refused real templates (a test failed beside a build). A worker that gets no CPU for 0.8 s
    (stopped, as a starved process is) still renders under a 0.2 s limit; a loop is refused
    after 0.2 s of CPU; a worker that never runs, by the wall clock's backstop."""
    template = Template("{% for m in messages %}{{ m.content }}{% endfor %}", "T")
    ctx = {"messages": [{"role": "user", "content": "hi"}]}
    with Renderer(RenderLimits(seconds=0.2, wall_seconds=20)) as renderer:
        assert renderer.render(template, [ctx]) == ["hi"]  # the worker started
        (pid,) = workers()
        os.kill(pid, signal.SIGSTOP)
        threading.Timer(0.8, os.kill, (pid, signal.SIGCONT)).start()
        start = time.perf_counter()
        assert renderer.render(template, [ctx]) == ["hi"]
        assert time.perf_counter() - start > 0.7
        with pytest.raises(LmcliError, match="did not render within 0.2 s of CPU time"):
            renderer.render(Template(LOOPS, "T"), [ctx])
    with Renderer(RenderLimits(seconds=0.2, wall_seconds=0.5)) as renderer:
        assert renderer.render(template, [ctx]) == ["hi"]
        os.kill(workers()[0], signal.SIGSTOP)
        start = time.perf_counter()
        with pytest.raises(LmcliError, match=r"did not render within 0.2 s of CPU time \(or 0.5 s in all\)"):
            renderer.render(template, [ctx])
        assert 0.5 <= time.perf_counter() - start < 2.5
    assert not workers()


def sft_args(tmp: Path, template: str) -> list[str]:
    """`train --task sft` on 20 rows with a tokenizer whose chat template is ``template``."""
    tok = tmp / "tok"
    tok.mkdir(exist_ok=True)
    shutil.copy(make_run(tmp / "base") / "last" / "tokenizer.json", tok / "tokenizer.json")
    (tok / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    rows = tmp / "rows.jsonl"
    rows.write_text("".join(json.dumps({"prompt": "the cat", "response": "sat"}) + "\n" for _ in range(20)))
    return ["train", str(rows), "--task", "sft", "--tokenizer", str(tok / "tokenizer.json"), *FAST_TRAIN_ARGS]


@pytest.mark.slow
def test_sft_with_a_looping_template_exits_2_and_leaves_no_run_folder(tmp_path: Path) -> None:
    """Row 2: `train --task sft` hung too."""
    out = tmp_path / "run"
    result, _, _ = lmcli(*sft_args(tmp_path, LOOPS), "--max-steps", "1", "--out", str(out))
    one_line(result, f"the chat template of {tmp_path / 'tok'} did not render within 2 s")
    assert not out.exists()


@pytest.mark.slow
@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_during_a_render_stops_training_at_once_and_removes_the_run_folder(
    tmp_path: Path, sig: int, code: int
) -> None:
    """Row 2 and a minor one: train ignored SIGINT while rendering; a SIGTERM left a run folder
    holding only `.lock`. The render is stopped at once: its worker is gone well before the 2 s
    of CPU time its limit would give it (measured so, the check holds on a loaded machine, where
    the interpreter's own exit after it, ~1.2 s of torch's teardown, takes longer)."""
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    argv = [sys.executable, "-m", "lmcli", *sft_args(tmp_path, LOOPS), "--max-steps", "1", "--out", str(out)]
    # Ctrl-C as a terminal gives it: a shell's background job (`make test &`) ignores SIGINT, and
    # so would the child, as a program started with SIGINT ignored should
    proc = subprocess.Popen(
        argv,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        deadline = time.monotonic() + 60
        while not (rendering := workers(proc.pid)) and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.05)
        assert rendering and out.exists(), "no render started"
        # inside the render: 0.4 s of the worker's CPU (its start takes ~0.15), so the loop runs;
        # a signal before that can find the caller in a C call that defers it (building the
        # tokenizer on a cold machine), which is not what this test measures
        while (cpu_seconds(rendering[0]) or 0) < 0.4 and time.monotonic() < deadline:
            time.sleep(0.02)
        start = time.perf_counter()
        proc.send_signal(sig)
        while workers(proc.pid) and time.perf_counter() - start < 10:
            time.sleep(0.02)
        # the worker killed: ~0.05 s here; left to its 2 s limit it would live 1.6 s more
        assert time.perf_counter() - start < 1.0
        assert proc.wait(60) == code, proc.stderr.read()
    finally:
        proc.kill()
        proc.wait()
    assert not out.exists(), list(out.iterdir())


ESCAPES = [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ cycler.__init__.__globals__.os.environ }}",
    "{{ joiner.__init__.__globals__.os.popen('touch MARK').read() }}",
    "{{ namespace.__init__.__globals__.os.system('touch MARK') }}",
    "{{ lipsum.__globals__['os'].popen('touch MARK').read() }}",
    "{{ self._TemplateReference__context.cycler.__init__.__globals__.os }}",
    "{{ raise_exception.__globals__ }}",
    "{{ messages.__class__.__base__.__subclasses__() }}",
    "{{ (messages|attr('__class__')) }}",
    "{% for c in [].__class__.__base__.__subclasses__() %}{{ c }}{% endfor %}",
    "{{ strftime_now.__globals__ }}",
    "{{ tojson.__globals__['json'] }}",
]


def test_the_sandbox_holds_against_escapes_and_the_worker_sees_no_secrets(
    tmp_path: Path, monkeypatch
) -> None:
    """Row 2: the sandbox held against 33 escapes; it still does, in a process with an empty
    environment, so even an escape would find neither the caller's secrets nor its files."""
    monkeypatch.setenv("LMCLI_SECRET", "hunter2")
    monkeypatch.chdir(tmp_path)
    context = {"messages": [{"role": "user", "content": "x"}], "add_generation_prompt": True}
    with Renderer(RenderLimits(seconds=5)) as renderer:
        for text in ESCAPES:
            try:
                out = renderer.render(Template(text, "evil"), [context])[0]
            except LmcliError as exc:
                assert "unsafe" in str(exc) or "undefined" in str(exc) or "has no attribute" in str(exc), exc
            else:
                assert "hunter2" not in out and "<class" not in out, (text, out)
    assert not (tmp_path / "MARK").exists()


# ----------------------------------------------------------------------------- 5: chat --json input
@pytest.mark.slow
def test_chat_json_input_is_bounded_and_old_turns_drop_in_a_few_renders(chat_run: Path) -> None:
    """Row 5: a 10 MB message took 3.9 GB and 19 s; 2,000 turns (146 KB) took 34 s. The message
    is known too long without being tokenized; the turns that fit are found by bisection."""
    argv = ["chat", str(chat_run), "--json", "--device", "cpu", "--max-new-tokens", "4"]
    result, _, base = lmcli(*argv, stdin=HI)
    assert result.returncode == 0, result.stderr
    message = "the cat " * 1_250_000
    huge = json.dumps({"messages": [{"role": "user", "content": message}]})
    result, _, peak = lmcli(*argv, stdin=huge)
    one_line(result, "the prompt is more characters than it can hold: no room for a reply")
    assert peak < base + 200, (peak, base)
    session = ChatSession.from_checkpoint(load_model(chat_run), SampleConfig(max_new_tokens=4, seed=1))
    start = time.perf_counter()
    with pytest.raises(LmcliError, match="more characters than it can hold"):
        session.say(message)
    turns = [
        {"role": r, "content": f"turn {i} of the cat"} for i in range(1000) for r in ("user", "assistant")
    ]
    session.load([*turns, {"role": "user", "content": "and now?"}])
    reply = session.reply()
    assert reply.dropped > 1990 and time.perf_counter() - start < 5.0, (
        reply.dropped,
        time.perf_counter() - start,
    )


def test_chat_json_reads_at_most_16_mib() -> None:
    with pytest.raises(LmcliError, match="stdin holds more than 16 MiB"):
        read_messages(io.BytesIO(b" " * (17 << 20)))


# ----------------------------------------------------------------------------- 6: /save


def test_save_refuses_a_fifo_and_keeps_it(chat_run: Path, tmp_path: Path) -> None:
    """Row 6: /save replaced a FIFO (and a device node: as root, /dev/null) with a file."""
    s = ChatSession.from_checkpoint(load_model(chat_run), SampleConfig(max_new_tokens=2))
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "target")
    for path, kind in ((fifo, "a device or a FIFO"), (link, "a symbolic link"), (tmp_path, "a folder")):
        with pytest.raises(LmcliError, match=f"it is {kind}, not a regular file"):
            s.save(path)
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode) and link.is_symlink() and not (tmp_path / "target").exists()
    s.save(tmp_path / "conversation.json")
    assert json.loads((tmp_path / "conversation.json").read_text()) == {"messages": []}


# ----------------------------------------------------------------------------- 8: bytes and surrogates
@pytest.mark.slow
def test_a_raw_byte_or_a_lone_surrogate_on_chat_json_is_one_line(chat_run: Path, capsys, monkeypatch) -> None:
    """Row 8: both were "internal error" (exit 1)."""
    result, _, _ = lmcli("chat", str(chat_run), "--json", "--device", "cpu", stdin=b'{"messages": "\xff"}')
    one_line(result, "stdin is not UTF-8 text: byte 0xff at 14")
    surrogate = '{"messages": [{"role": "user", "content": "a\\ud800b"}]}'
    code, _, err = run_cli(
        ["chat", str(chat_run), "--json"], capsys, stdin=surrogate, monkeypatch=monkeypatch
    )
    assert_one_line_error(code, err, "messages[0].content holds a lone surrogate (U+D800): not text")


def test_sft_rows_with_a_lone_surrogate_or_invalid_utf8(tmp_path: Path, capsys) -> None:
    """Row 8: a lone surrogate in an SFT row was an internal error; minor: invalid UTF-8 in the
    rows gave no warning."""
    args = sft_args(tmp_path, "{% for m in messages %}{{ m['content'] }}{{ eos_token }}{% endfor %}")
    rows = Path(args[1])
    rows.write_text(rows.read_text() + '{"prompt": "x\\udc80", "response": "y"}\n')
    code, _, err = run_cli([*args, "--max-steps", "1", "--out", str(tmp_path / "a")], capsys)
    assert_one_line_error(code, err, f"{rows}:21: 'user' holds a lone surrogate (U+DC80): not text")
    rows.write_bytes(rows.read_bytes().replace(b"x\\udc80", b"x\xff\xfe"))
    code, _, err = run_cli([*args, "--max-steps", "1", "--out", str(tmp_path / "b")], capsys)
    assert code == 0 and f"warning: replaced 2 invalid UTF-8 sequence(s) in {rows}" in err, err
