"""Tests for envs.py: experts solve every instance, determinism, reward rules, fuzzing, the code sandbox.

Run: python -m pytest -q test_envs_part.py   (pure Python, no torch; well under a minute on 2 cores)
"""
import random
import re
import time
from collections import deque

import pytest

import envs
from envs import FORMAT_PENALTY, ENVS, make_env, parse_reply, step_reply

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


def test_step_reply():
    env = make_env("sokoban")
    env.reset(0)
    before = env.render()
    assert step_reply(env, "no tags") == (before, FORMAT_PENALTY, False,
                                          {"valid": False, "success": False, "format_ok": False})
    obs, reward, done, info = step_reply(env, reply("t", "up", "jump"))  # second action invalid
    assert reward == pytest.approx(-0.1 + FORMAT_PENALTY) and not info["valid"] and info["format_ok"]
    env = make_env("frozenlake")  # three moves: only two are applied
    env.reset(1)
    env.pos, env.goal, env.holes = (0, 0), (3, 3), set()
    step_reply(env, reply("t", "down", "down", "down"))
    assert env.pos == (2, 0)
    env.pos, env.goal = (0, 0), (1, 0)  # stops at done: "up" after reaching the goal is not applied
    obs, reward, done, info = step_reply(env, reply("t", "down", "up"))
    assert (reward, done, info["success"], env.pos) == (1.0, True, True, (1, 0))


def test_make_env():
    assert make_env("frozenlake-mixed").name == "frozenlake-mixed"
    assert make_env("sokoban", max_turns=8).max_turns == 8
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


def test_frozenlake_mixed_has_both_kinds():
    env = make_env("frozenlake-mixed")
    kinds = [(env.reset(s), env.solvable)[1] for s in range(200)]
    assert 60 < sum(kinds) < 140
    for seed in range(200):
        env.reset(seed)
        assert lake_has_path(env.render()) == env.solvable


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
    for bad in ["3*5+", "3 5 7", "x+1", "3.0*5+7", "-3+5", "3**5", "__import__('os')", "", "3*5+7 = 22"]:
        obs, reward, done, info = attempt(bad)
        assert (reward, done, info["valid"]) == (0.0, False, False), bad
    env = make_env("countdown", max_turns=2)
    env.reset(0)
    env.numbers, env.target = [3, 5, 7], 22
    obs, reward, done, _ = env.step("3+5+7")
    assert (reward, done) == (0.1, False) and "Last: 3+5+7 = 15" in obs
    assert env.step("3*5+7")[1:3] == (1.0, True)


def test_bandit_rewards():
    env = make_env("bandit")
    paid = 0
    for seed in range(2000):
        env.reset(seed)
        assert env.render().count("(steady)") == 1 and env.render().count("(risky)") == 1
        if seed % 2:
            assert env.step(env.steady.upper())[1:] == (0.1, True, {"valid": True, "success": False})
        else:
            _, reward, done, info = env.step(env.risky)
            assert reward in (0.0, 1.0) and done and info["success"]
            paid += reward
    assert 0.2 < paid / 1000 < 0.3
    env.reset(0)
    assert env.step("unicorn")[1:] == (FORMAT_PENALTY, False, {"valid": False, "success": False})


def test_webshop_rewards():
    env = make_env("webshop")
    for seed in range(30):
        obs = env.reset(seed)
        cap = int(re.search(r"under \$(\d+)", obs).group(1))
        want = env.target
        for bad in ["click[buy]", "click[p00]", "search[]", "buy", "search[red", "click[back]"]:
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


def test_code_rewards():
    env = make_env("code")
    env.reset(0)
    env.tests = [([1, 2], 3), ([5], 5), ([0, 0, 4], 0), ([7, 1], 8)]
    assert env.step("x[0] + x[1]")[1:] == (0.75, False, {"valid": True, "success": False})
    assert "failing: f([5]) = 5, got error" in env.render()
    assert env.step("x.pop()")[1:] == (FORMAT_PENALTY, False, {"valid": False, "success": False})
    assert env.attempts == 1
    assert env.step("x[0]")[1] == pytest.approx(0.5 - 0.75)  # got worse: negative reward
    assert env.step("sum(x[:2])")[1:] == (pytest.approx(0.5), True, {"valid": True, "success": True})
    env.reset(0)
    env.tests = [(2, 7), (0, 1)]
    for _ in range(3):
        obs, reward, done, info = env.step("x")
    assert done and not info["success"] and "Passed 0/2" in obs


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


@pytest.mark.parametrize("code", REFUSED + BOUNDED)
def test_code_sandbox_refuses_or_bounds(code):
    env = make_env("code")
    env.reset(1)
    t = time.perf_counter()
    obs, reward, done, info = env.step(code)
    assert time.perf_counter() - t < 1.0
    assert (not info["valid"] and reward == FORMAT_PENALTY) or (reward <= 0 and not info["success"])
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
