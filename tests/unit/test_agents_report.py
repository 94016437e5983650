"""tools.agents' report without npm, a server or a model: requests (as GET /admin/requests
lists them) by turn, their rows, and the exit status."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from tools.agents import (
    ServerRun,
    Step,
    assign,
    codex_config,
    format_report,
    opencode_argvs,
    opencode_env,
)


def req(t: float, status: int = 200, path: str = "/v1/messages", **kw: Any) -> dict[str, Any]:
    return {"time": t, "method": "POST", "path": path, "status": status, **kw}


def gen(t: float, prompt: int, cached: int, ttft: float, **kw: Any) -> dict[str, Any]:
    return req(t, **{"prompt_tokens": prompt, "cached_tokens": cached,
                     "prefilled": prompt - cached, "output_tokens": 64, "ttft_s": ttft,
                     "miss": None, **kw})


STEPS = [Step("claude", "gemma3", "turn 1", 100.0, 200.0, may_overflow=True),
         Step("claude", "gemma3", "turn 2", 200.0, 300.0),
         Step("claude", "gemma3", "new session", 300.0, 400.0)]


def rows(lines: list[str]) -> list[list[str]]:
    """The table's rows, split on runs of two or more spaces."""
    end = lines.index("")
    return [re.split(r"\s{2,}", line.strip()) for line in lines[1:end]]


def test_each_request_goes_to_the_turn_that_had_started_when_it_ended() -> None:
    reqs = [req(50.0), req(150.0), req(201.0), req(299.0), req(301.0)]
    owners = [s.turn if s else None for s, _ in assign(STEPS, reqs)]
    assert owners == [None, "turn 1", "turn 2", "turn 2", "new session"]
    # a request that ended after its turn's process (cut short) still counts for it
    assert assign(STEPS[:1], [req(250.0)])[0][0] is STEPS[0]


def test_rows_show_status_tokens_ttft_and_turn_and_all_2xx_exits_0() -> None:
    reqs = [{"time": 101.0, "method": "HEAD", "path": "/", "status": 200},
            gen(150.0, 19647, 0, 207.07),
            gen(250.0, 19760, 19710, 2.19),
            gen(350.0, 19650, 4096, 40.5, miss="new conversation")]
    report = format_report([ServerRun("gemma3", STEPS, reqs)])
    got = rows(report.lines)
    assert got[0] == ["claude", "gemma3", "turn 1", "HEAD /", "200", "-", "-", "-", "-", "-",
                      "-"]
    assert got[1] == ["claude", "gemma3", "turn 1", "POST /v1/messages", "200", "19,647", "-",
                      "0", "19,647", "64", "207.07 s"]
    assert got[2][2:9] == ["turn 2", "POST /v1/messages", "200", "19,760", "-", "19,710",
                           "50"]
    assert got[3][2] == "new session" and got[3][-1] == "new conversation"
    assert report.exit_code == 0 and report.failures == []
    assert "OK: every request got a 2xx status." in report.lines
    turns = [ln.strip() for ln in report.lines if ln.startswith("  claude on gemma3")]
    assert turns[1].endswith("1 request(s); first request reused 19,710 of 19,760 tokens")
    assert turns[2].endswith("first request reused 4,096 of 19,650 tokens")
    assert turns[0].startswith("claude on gemma3, turn 1: exit 0 after 100.0 s, 2 request(s)")


def test_a_turn_that_failed_or_timed_out_says_how_it_ended_without_failing_the_run() -> None:
    steps = [Step("codex", "gemma3", "turn 1", 100.0, 200.0, exit_code=1,
                  detail="ERROR: Incomplete response returned, reason: max_output_tokens"),
             Step("codex", "gemma3", "turn 2", 200.0, 1100.0, exit_code=None, timed_out=True)]
    report = format_report([ServerRun("gemma3", steps, [gen(150.0, 10, 0, 0.1),
                                                         gen(250.0, 20, 10, 0.1)])])
    assert ("  codex on gemma3, turn 1: exit 1 (ERROR: Incomplete response returned, reason: "
            "max_output_tokens) after 100.0 s, 1 request(s); first request reused 0 of 10 "
            "tokens") in report.lines
    assert any(ln.startswith("  codex on gemma3, turn 2: timed out after 900.0 s")
               for ln in report.lines)
    assert report.exit_code == 0


def test_a_non_2xx_request_fails_with_the_servers_reason_after_the_whole_table() -> None:
    reason = "System messages are only supported at the start of the conversation."
    reqs = [gen(150.0, 100, 0, 0.1), req(250.0, 400, error=reason), gen(350.0, 100, 90, 0.1)]
    report = format_report([ServerRun("gemma3", STEPS, reqs)])
    assert report.exit_code == 1
    assert report.failures == [
        f"claude on gemma3, turn 2: POST /v1/messages -> 400: {reason}"]
    got = rows(report.lines)
    assert len(got) == 3 and got[1][4] == "400" and got[1][-1] == reason
    assert report.lines.index("FAILED: 1 problem(s):") > report.lines.index("Turns:")


def test_requests_outside_any_turn_and_turns_without_requests_fail_too() -> None:
    reqs = [req(50.0, 404, path="/", error="no such endpoint"), gen(150.0, 10, 0, 0.1),
            gen(350.0, 10, 0, 0.1)]
    report = format_report([ServerRun("gemma3", STEPS, reqs)])
    assert report.exit_code == 1
    assert report.failures == ["outside any turn: POST / -> 404: no such endpoint",
                               "claude on gemma3, turn 2: no request reached the server"]


def test_a_prompt_past_the_context_on_turn_1_is_a_finding_not_a_failure() -> None:
    error = ("this model's context is 8192 tokens; the prompt is 40,620 bytes, so at least "
             "10,155 tokens, which leaves no room for a reply")
    steps = [Step("codex", "smollm2", "turn 1", 100.0, 110.0, exit_code=1, may_overflow=True)]
    report = format_report([ServerRun("smollm2", steps, [req(105.0, 400, "/v1/responses",
                                                             error=error)],
                                      notes=["codex's prompt does not fit"])])
    assert report.exit_code == 0
    assert rows(report.lines)[0][-1].startswith("does not fit: this model's context is 8192")
    assert "  codex's prompt does not fit" in report.lines
    # the same refusal on a later turn is a failure
    late = [Step("codex", "smollm2", "turn 2", 100.0, 110.0)]
    assert format_report([ServerRun("smollm2", late, [req(105.0, 400, error=error)])]
                         ).exit_code == 1


def test_a_server_that_failed_fails_the_run() -> None:
    report = format_report([ServerRun("gemma3", [], [], problems=["statecache did not start"])])
    assert report.failures == ["gemma3: statecache did not start"]
    assert report.exit_code == 1


def test_codex_keeps_its_default_tools_web_search_included() -> None:
    config = codex_config(8123)
    assert 'base_url = "http://127.0.0.1:8123/v1"' in config
    assert 'wire_api = "responses"' in config
    assert "web_search" not in config


def test_opencode_talks_to_the_server_alone_with_its_limits(tmp_path: Path) -> None:
    env = opencode_env(tmp_path / "home", 8123, 8192, 32)
    config = json.loads(Path(env["OPENCODE_CONFIG"]).read_text())
    provider = config["provider"]["statecache"]
    assert config["model"] == "statecache/local" and list(config["provider"]) == ["statecache"]
    assert provider["options"]["baseURL"] == "http://127.0.0.1:8123/v1"
    assert provider["models"]["local"]["limit"] == {"context": 8192, "output": 32}
    assert env["HOME"] == str(tmp_path / "home") and env["OPENCODE_DISABLE_MODELS_FETCH"] == "1"
    assert not {k for k in env if "KEY" in k or "BASE_URL" in k}
    argvs = opencode_argvs(Path("opencode"))
    assert argvs["turn 2"][1:3] == ["run", "--continue"]
    assert "--continue" not in argvs["new session"]


def test_a_side_request_beside_the_agents_prompt_is_passed_over() -> None:
    """opencode's title request (590 tokens) ends first; the turn's line is about its
    prompt (2,237 tokens)."""
    steps = [Step("opencode", "smollm2", "new session", 100.0, 200.0)]
    reqs = [gen(110.0, 590, 577, 0.3, shared=577), gen(120.0, 2237, 2224, 0.2, shared=2224),
            gen(130.0, 2300, 2237, 0.2)]
    line = next(ln for ln in format_report([ServerRun("smollm2", steps, reqs)]).lines
                if "new session:" in ln)
    assert line.endswith("3 request(s); first request reused 2,224 of 2,237 tokens, 100.0% "
                         "of the 2,224 an earlier request held")


def test_a_new_session_says_what_share_of_the_shared_prefix_it_reused() -> None:
    reqs = [gen(350.0, 19650, 18150, 10.5, shared=18160)]
    report = format_report([ServerRun("gemma3", STEPS, reqs)])
    assert rows(report.lines)[0][5:7] == ["19,650", "18,160"]
    line = next(ln for ln in report.lines if "new session" in ln and "reused" in ln)
    assert line.endswith("reused 18,150 of 19,650 tokens, 99.9% of the 18,160 an earlier "
                         "request held")
