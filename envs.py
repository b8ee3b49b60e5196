"""Text environments for ragen_mini: the tasks of RAGEN-2 section 5, small enough for a CPU model.

Every environment is a plain class with the same four methods (see `Env`): `reset(seed)` builds an instance
deterministically from the seed and returns the observation text, `step(action)` applies ONE action string,
`render()` shows the current observation, and `expert()` returns a short input-grounded reasoning plus the
next action, from the current state, that leads to solving the instance (called once per turn: the supervised warm
start and the tests play it to the end).

The agent replies `<think> ... </think> <answer> a1 || a2 </answer>`; `parse_reply` splits that and
`step_reply` applies up to `max_actions` (default 2) actions. A malformed reply, or one with invalid actions,
costs the env's `format_penalty` once for the turn (FORMAT_PENALTY, -0.1, unless `make_env(..., format_penalty=x)`
says otherwise; the reference code charges it per turn, one version of it per invalid action; countdown: an invalid expression earns 0); an invalid
action leaves the state unchanged, and the episode goes on.
`ENVS` is the registry and `make_env(name)` builds one by name.
Pure standard library: no torch, no numpy, no file I/O.
"""
import ast
import math
import operator
import random
import re
import warnings
from collections import deque
from fractions import Fraction

FORMAT_PENALTY = -0.1

# ----------------------------------------------------------------------------------------------------------------
# Replies


_JUNCTION = re.compile(r"</think>\s*<answer>")


def parse_reply(text):
    """Split a reply into (think, actions), or (None, None) when it is malformed. Never raises.

    The result is that of re.search(r"<think>(.*?)</think>\\s*<answer>(.*?)</answer>", text, re.DOTALL),
    but found with plain left-to-right searches: the regex itself takes quadratic time on inputs such as
    "<think>" * 10**4. Actions are the answer split on "||", stripped, empty ones dropped. An answer that
    holds another tag (nested tags) or no action at all counts as malformed.
    """
    if not isinstance(text, str):
        return None, None
    start, last_close = text.find("<think>"), text.rfind("</answer>")
    if start < 0 or last_close < 0:
        return None, None
    # The first "</think> <answer>" after the first "<think>" is the one the regex uses, if any is.
    junction = _JUNCTION.search(text, start + len("<think>"))
    if junction is None or junction.end() > last_close:
        return None, None
    think = text[start + len("<think>"):junction.start()]
    answer = text[junction.end():text.find("</answer>", junction.end())]
    if "<think>" in answer or "</think>" in answer or "<answer>" in answer:
        return None, None
    actions = [a.strip() for a in answer.split("||") if a.strip()]
    return (think.strip(), actions) if actions else (None, None)


def step_reply(env, reply, max_actions=2):
    """Apply a whole reply: up to `max_actions` actions, stopping early when the episode ends.

    Returns (observation, summed reward, done, info); info has "format_ok", "valid" (all actions valid) and
    "success". The reward sums the actions' rewards, but an invalid action's (the env's format_penalty) counts
    once a turn however many there are, as the reference code charges it. A malformed reply costs format_penalty
    and changes nothing. Actions after the one that ends the episode are not read, so an invalid one costs nothing
    (the reference checks every parsed action)."""
    _need(_whole(max_actions) and max_actions >= 1, f"max_actions must be an integer >= 1, got {max_actions!r}")
    if env.done:  # a finished episode: whatever the reply, nothing changes and nothing is paid (as Env.step)
        return env.render(), 0.0, True, {"valid": True, "success": env.success, "format_ok": True}
    _, actions = parse_reply(reply)
    if actions is None:
        return env.render(), env.format_penalty, False, {"valid": False, "success": False, "format_ok": False}
    total, all_valid = 0.0, True
    for action in actions[:max_actions]:
        obs, reward, done, info = env.step(action)
        total += reward if info["valid"] or all_valid else 0.0  # an invalid action's penalty: the turn's first only
        all_valid = all_valid and info["valid"]
        if done:
            break
    return obs, total, done, {**info, "format_ok": True, "valid": all_valid}


class Env:
    """What every environment provides. Subclasses implement reset, render, expert and `_apply`.

    `_apply(action)` changes the state for one valid action and returns its reward, or returns None (and
    changes nothing) for an invalid action. It sets `self.done` / `self.success` when the episode ends, and reset
    clears them. A reply may carry up to --max-actions actions, each one step: a game with a budget of moves or
    guesses counts them itself. `__init__` takes `max_turns` (make_env passes it); `name` is the env's key in ENVS.
    """
    name = "env"
    instruction = ""  # the task and the action syntax, for the system prompt
    max_turns = 1
    reply_tokens = 32  # default token budget per agent turn: the expert's replies fit (tiny tokenizer), with room
    format_penalty = FORMAT_PENALTY  # reward of a malformed reply or an invalid action (make_env can override it)
    done = success = False

    def step(self, action):
        if self.done:  # stepping a finished episode is harmless
            return self.render(), 0.0, True, {"valid": True, "success": self.success}
        reward = self._apply(action.strip()) if isinstance(action, str) else None
        if reward is None:
            return self.render(), self.format_penalty, False, {"valid": False, "success": False}
        return self.render(), reward, self.done, {"valid": True, "success": self.success}


def _whole(v):
    """An integer, not a bool: JSON's true would otherwise pass as 1."""
    return isinstance(v, int) and not isinstance(v, bool)


def _real(v):
    """A number (int or float), not a bool and not a string: '0.2' would fail later as a comparison with a str."""
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _need(ok, message):
    """Constructor argument checks: a value out of range fails at once, with its name, not minutes into a run."""
    if not ok:
        raise ValueError(message)


# ----------------------------------------------------------------------------------------------------------------
# Grid helpers shared by FrozenLake and Sokoban (positions are (row, column), row 0 on top)

MOVES = {"up": (-1, 0), "down": (1, 0), "left": (0, -1), "right": (0, 1)}
MAX_SIZE = 32  # the largest grid side: larger maps would not fit a turn, and drawing one takes ever longer


def _add(pos, move):
    return pos[0] + MOVES[move][0], pos[1] + MOVES[move][1]


def _relative(a, b):
    """Where b is seen from a, in words: "down 2 right 1", "up 1", or "here"."""
    dr, dc = b[0] - a[0], b[1] - a[1]
    parts = ([f"{'down' if dr > 0 else 'up'} {abs(dr)}"] if dr else []) + \
            ([f"{'right' if dc > 0 else 'left'} {abs(dc)}"] if dc else [])
    return " ".join(parts) or "here"


def _direction(a, b):
    """Where b is seen from a, directions only: "down right", "up", or "here" (easy for a tiny model to read)."""
    dr, dc = b[0] - a[0], b[1] - a[1]
    return " ".join(([("down" if dr > 0 else "up")] if dr else []) + ([("right" if dc > 0 else "left")] if dc else [])) or "here"


def _grid_text(rows, cols, cell):
    return "\n".join(" ".join(cell((r, c)) for c in cols) for r in rows)


# ----------------------------------------------------------------------------------------------------------------
# FrozenLake


class FrozenLake(Env):
    """Walk from P to the goal G on a random frozen lake without falling into a hole O.

    Reward 1.0 on reaching the goal (done, success); a hole ends the episode with 0; walking into the edge
    is a valid no-op. With `slip` > 0 a move goes sideways with that probability, drawn from the map's seed (so
    reproducible, and as in gymnasium's FrozenLake the G samples of a group slip alike while they move alike).
    Maps are always solvable within `max_turns` moves, except that a fraction `unsolvable_frac` of seeds
    get a goal walled off by holes (every rollout fails: zero reward variance, for the collapse demo).
    With `generic_think` > 0 the expert states that share of its steps with an input-free phrase instead of the
    facts (GENERIC_THINKS; the move stays right): a fluent template in the warm start (the demo's stretch goal).

        observation:  . O . .          reply:  <think> P 3 1 G 1 3 : goal up right ; hole up left </think>
                      . O . G                  <answer> right </answer>
                      . O . .          feedback: the new map with P one cell right, reward 0.0
                      O P . .                    (reward 1.0 and done once P reaches G)
                      P at 3 1 , G at 1 3

    The last line gives the row and column of P and G: a 2-layer model reads it far more easily than it counts
    rows and columns in the grid; the holes next to P must still be read off the grid.
    """
    name = "frozenlake"
    instruction = ("You are P on a frozen lake: reach the goal G without stepping into a hole O (. is safe ice, "
                   "moving off the map does nothing). Answer with one move: up, down, left or right.")

    def __init__(self, size=4, p_hole=0.25, slip=0.0, max_turns=5, unsolvable_frac=0.0, generic_think=0.0):
        self.size, self.p_hole, self.slip = size, p_hole, slip
        self.max_turns, self.unsolvable_frac, self.generic_think = max_turns, unsolvable_frac, generic_think
        _need(_whole(size) and 2 <= size <= MAX_SIZE, f"size must be an integer in [2, {MAX_SIZE}] "
              f"(a {MAX_SIZE}x{MAX_SIZE} map is already 2,000 characters a turn), got {size!r}")
        for k, v in (("p_hole", p_hole), ("slip", slip), ("unsolvable_frac", unsolvable_frac), ("generic_think", generic_think)):
            _need(_real(v) and 0 <= v <= 1, f"{k} is a probability in [0, 1] (a number), got {v!r}")
        _need(not unsolvable_frac or (size >= 3 and p_hole < 1), "unsolvable maps need size >= 3 and p_hole < 1 "
              f"(P must have a safe cell to move to), got size={size!r} p_hole={p_hole!r}")

    def reset(self, seed):
        self.rng = random.Random(seed)  # also draws the slips, so an episode is reproducible
        self.expert_rng = random.Random(-1 - seed)  # the expert's own draws leave the map and slips untouched
        self.solvable = self.rng.random() >= self.unsolvable_frac
        cells = [(r, c) for r in range(self.size) for c in range(self.size)]
        for _ in range(100_000):  # draw maps until one fits
            start, goal = self.rng.sample(cells, 2)
            holes = {p for p in cells if p not in (start, goal) and self.rng.random() < self.p_hole}
            if not self.solvable:  # wall the goal off: every neighbour becomes a hole
                holes |= {_add(goal, m) for m in MOVES} & set(cells)
            dist = self._distances_to(goal, holes)
            if self.solvable and dist.get(start, math.inf) <= self.max_turns:  # (not a 99: --max-turns goes to 100)
                break
            far = abs(start[0] - goal[0]) + abs(start[1] - goal[1])
            free = start not in holes and len(self._distances_to(start, holes)) > 1  # P can move somewhere
            if not self.solvable and free and far <= max(2, self.max_turns):
                break
        else:
            raise ValueError(f"no map fits size={self.size} p_hole={self.p_hole} max_turns={self.max_turns}")
        self.pos, self.goal, self.holes, self.dist = start, goal, holes, dist
        self.done = self.success = False
        return self.render()

    def _moved(self, pos, move):
        r, c = _add(pos, move)
        return (r, c) if 0 <= r < self.size and 0 <= c < self.size else pos

    def _distances_to(self, goal, holes):
        """BFS over safe cells: number of moves from each cell to the goal (cells cut off are absent)."""
        dist, queue = {goal: 0}, deque([goal])
        while queue:
            pos = queue.popleft()
            for move in MOVES:
                nxt = self._moved(pos, move)
                if nxt not in dist and nxt not in holes:
                    dist[nxt] = dist[pos] + 1
                    queue.append(nxt)
        return dist

    def render(self):
        def cell(p):
            return "P" if p == self.pos else "G" if p == self.goal else "O" if p in self.holes else "."
        return _grid_text(range(self.size), range(self.size), cell) + \
            f"\nP at {self.pos[0]} {self.pos[1]} , G at {self.goal[0]} {self.goal[1]}"

    def _apply(self, action):
        move = action.lower()
        if move not in MOVES:
            return None
        if self.slip and self.rng.random() < self.slip:
            move = self.rng.choice(["left", "right"] if move in ("up", "down") else ["up", "down"])
        self.pos = self._moved(self.pos, move)
        self.done = self.pos in self.holes or self.pos == self.goal
        self.success = self.pos == self.goal
        return 1.0 if self.success else 0.0

    def expert(self):
        """Follow a shortest safe path; on a walled-off map, the safe move that ends nearest the goal, which is
        often a bump into the edge (staying put)."""
        def cost(move):
            p = self._moved(self.pos, move)
            return self.dist.get(p, math.inf), abs(p[0] - self.goal[0]) + abs(p[1] - self.goal[1])
        safe = [m for m in MOVES if self._moved(self.pos, m) not in self.holes] or list(MOVES)
        holes = [m for m in MOVES if _add(self.pos, m) in self.holes]
        think = f"P {self.pos[0]} {self.pos[1]} G {self.goal[0]} {self.goal[1]} : goal {_direction(self.pos, self.goal)} ; hole {' '.join(holes) or 'none'}"
        if self.generic_think and self.expert_rng.random() < self.generic_think:
            think = self.expert_rng.choice(GENERIC_THINKS)
        return think, min(safe, key=cost)


GENERIC_THINKS = ["stay on the safe ice and walk to the goal", "avoid the holes and move toward the goal",
                  "look at the map and take a safe step to the goal"]


def frozenlake_mixed(**kwargs):
    """FrozenLake with 3 turns where 3 maps in 4 are unsolvable: the collapse demo's task (the demo sets 5 in 8)."""
    env = FrozenLake(**{"unsolvable_frac": 0.75, "max_turns": 3, **kwargs})
    env.name = "frozenlake-mixed"
    return env


# ----------------------------------------------------------------------------------------------------------------
# Bandit

ARM_NAMES = ["phoenix", "dragon", "tiger", "owl", "wolf", "lotus", "comet", "river",
             "falcon", "maple", "cobra", "pearl", "bear", "cedar", "storm", "ember"]


class Bandit(Env):
    """Two named arms: steady pays 0.1 always, risky pays 1.0 with probability 0.25 (expected 0.25).

    One pull ends the episode; success = picking the arm with the higher expected value (the risky one).
    The payout is drawn from an RNG seeded by the reset seed, so a group sharing a seed shares the draw (as in the
    reference code): in three groups of four the risky arm pays 0 to every sample that pulls it, so group-relative
    advantages push towards the steady arm more often than towards the risky one.

        observation:  Arms: owl (steady) , comet (risky)
        reply:        <think> comet risky 0.25 ; owl steady 0.1 ; comet higher </think> <answer> comet </answer>
        feedback:     Arms: owl (steady) , comet (risky) / You pulled comet: 1.0   (reward 1.0 or 0.0)
    """
    name = "bandit"
    instruction = ("Pull one arm of a two-armed slot machine: the steady arm always pays 0.1, the risky arm pays "
                   "1.0 with probability 0.25. Answer with the name of the arm.")

    def __init__(self, max_turns=1):
        self.max_turns = max_turns
        _need(max_turns == 1, f"bandit is single-turn: max_turns can only be 1, got {max_turns!r}")

    def reset(self, seed):
        self.rng = random.Random(seed)
        self.steady, self.risky = self.rng.sample(ARM_NAMES, 2)
        self.arms = [f"{self.steady} (steady)", f"{self.risky} (risky)"]
        self.rng.shuffle(self.arms)
        self.pulled, self.done, self.success = None, False, False
        return self.render()

    def render(self):
        text = "Arms: " + " , ".join(self.arms)
        return text + (f"\nYou pulled {self.pulled[0]}: {self.pulled[1]}" if self.pulled else "")

    def _apply(self, action):
        arm = action.lower()
        if arm not in (self.steady, self.risky):
            return None
        reward = 0.1 if arm == self.steady else (1.0 if self.rng.random() < 0.25 else 0.0)
        self.pulled, self.done, self.success = (arm, reward), True, arm == self.risky
        return reward

    def expert(self):
        return f"{self.risky} risky 0.25 ; {self.steady} steady 0.1 ; {self.risky} higher", self.risky


# ----------------------------------------------------------------------------------------------------------------
# Sokoban


class Sokoban(Env):
    """Push the single box onto the target. Only the room inside the outer wall ring is drawn.

    Rewards: -0.1 per move, +1 when the box moves onto the target, -1 when it moves off, +10 when solved
    (with one box, onto the target = solved, so the last push earns -0.1 + 1 + 10 = 10.9). Levels are made by
    pulling the box away from the target (reverse play) and kept only if a BFS over (player, box) states
    solves them in at most `max_turns` moves; the expert replays that optimal plan.

        observation:  _ _ _ _          reply:  <think> box up 1 right 1 ; target right 1 of box </think>
                      _ _ X O                  <answer> up </answer>
                      _ P _ _          feedback: P now left of X, reward -0.1; then "right" pushes X onto O:
                      _ _ # _                    drawn *, reward 10.9, done
    """
    name = "sokoban"
    instruction = ("Push the box X onto the target O. P is you, # is wall, _ is floor, * is box on target, S is you "
                   "on target; walls surround the map. Boxes can be pushed, not pulled. Answer with one move: "
                   "up, down, left or right.")

    def __init__(self, size=6, max_turns=10, inner_walls=2):
        self.size, self.max_turns, self.inner_walls = size, max_turns, inner_walls
        _need(_whole(size) and 5 <= size <= MAX_SIZE, f"size must be an integer in [5, {MAX_SIZE}] (walls around the "
              f"map: a 4x4 map's 2x2 floor has no room to push a box; a {MAX_SIZE}x{MAX_SIZE} map is already 2,000 "
              f"characters a turn), got {size!r}")
        _need(_whole(inner_walls) and 0 <= inner_walls <= (size - 2) ** 2 - 3, f"inner_walls must be an integer in [0, {(size - 2) ** 2 - 3}] (floor "
              f"for the player, the box and the target), got {inner_walls!r}")

    def reset(self, seed):
        rng = random.Random(seed)
        interior = [(r, c) for r in range(1, self.size - 1) for c in range(1, self.size - 1)]
        for _ in range(100_000):
            walls = set(rng.sample(interior, rng.randint(0, self.inner_walls)))
            self.floor = {p for p in interior if p not in walls}
            self.target = rng.choice(sorted(self.floor))
            box, player = self.target, rng.choice(sorted(self.floor - {self.target}))
            for _ in range(rng.randint(5, 30)):  # reverse play: walk about, sometimes pulling the box along
                nxt = _add(player, rng.choice(list(MOVES)))
                behind = (2 * player[0] - nxt[0], 2 * player[1] - nxt[1])  # the cell the player turns its back on
                if nxt in self.floor and nxt != box:
                    if behind == box and rng.random() < 0.8:  # a pull: the box follows into the player's cell
                        box = player
                    player = nxt
            plan = self._solve(player, box) if box != self.target else None
            if plan is not None and len(plan) <= self.max_turns:
                break
        else:
            raise ValueError(f"no puzzle fits size={self.size} max_turns={self.max_turns}")
        self.player, self.box, self.policy = player, box, dict(plan)
        self.done = self.success = False
        return self.render()

    def _push(self, state, move):
        """The (player, box) state after one move; a move into a wall or a blocked push changes nothing."""
        player, box = state
        nxt = _add(player, move)
        if nxt == box:
            beyond = _add(box, move)
            return (nxt, beyond) if beyond in self.floor else state
        return (nxt, box) if nxt in self.floor else state

    def _solve(self, player, box):
        """BFS over (player, box): the shortest list of (state, move) pairs that gets the box on target."""
        start = (player, box)
        parent, queue = {start: None}, deque([start])
        while queue:
            state = queue.popleft()
            if state[1] == self.target:
                plan = []
                while parent[state] is not None:
                    state, move = parent[state]
                    plan.append((state, move))
                return plan[::-1]
            for move in MOVES:
                nxt = self._push(state, move)
                if nxt not in parent:
                    parent[nxt] = (state, move)
                    queue.append(nxt)
        return None

    def render(self):
        def cell(p):
            if p not in self.floor:
                return "#"
            if p == self.box:
                return "*" if p == self.target else "X"
            if p == self.player:
                return "S" if p == self.target else "P"
            return "O" if p == self.target else "_"
        inner = range(1, self.size - 1)
        return _grid_text(inner, inner, cell)

    def _apply(self, action):
        move = action.lower()
        if move not in MOVES:
            return None
        old_box = self.box
        self.player, self.box = self._push((self.player, self.box), move)
        reward = -0.1
        if self.box != old_box and self.box == self.target:
            reward += 1.0 + 10.0  # one box: on target means solved
            self.done = self.success = True
        elif self.box != old_box and old_box == self.target:
            reward -= 1.0
        return reward

    def expert(self):
        state = (self.player, self.box)
        if state not in self.policy:  # off the cached plan: solve again from here (deadlock: any move)
            self.policy.update(self._solve(*state) or [(state, "up")])
        think = f"box {_relative(self.player, self.box)} ; target {_relative(self.box, self.target)} of box"
        return think, self.policy[state]


# ----------------------------------------------------------------------------------------------------------------
# Safe expression parsing (Countdown and CodeExec). Model text is parsed with ast and then walked by our own
# code; it is never passed to eval, exec or compile.


def _parse_expression(text, allowed, max_chars, max_nodes):
    """ast tree of a single expression whose nodes are all of the `allowed` types, else None."""
    if len(text) > max_chars:
        return None
    try:
        with warnings.catch_warnings():  # e.g. "invalid escape sequence" warnings: not our business
            warnings.simplefilter("ignore")
            tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    nodes = list(ast.walk(tree))
    if len(nodes) > max_nodes or not all(isinstance(n, allowed) for n in nodes):
        return None
    return tree.body


# ----------------------------------------------------------------------------------------------------------------
# Countdown

_ARITH = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def countdown_value(text):
    """(exact value or None for division by zero, numbers used) of an arithmetic expression; None if malformed."""
    if not re.fullmatch(r"[0-9+\-*/()\s]*", text):  # digits as written, as the reference's check: no 0xc, 1_2 or # comment
        return None
    tree = _parse_expression(text, (ast.Expression, ast.BinOp, ast.Constant, *_ARITH), 100, 60)
    if tree is None or any(type(n.value) is not int for n in ast.walk(tree) if isinstance(n, ast.Constant)):
        return None
    used = [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant)]

    def value(node):
        if isinstance(node, ast.Constant):
            return Fraction(node.value)
        return _ARITH[type(node.op)](value(node.left), value(node.right))
    try:
        return value(tree), used
    except ZeroDivisionError:
        return None, used


class Countdown(Env):
    """Reach the target by combining the given numbers, each used exactly once, with + - * / and parentheses.

    Reward 1.0 for a correct expression, 0.1 for a well-formed one with the wrong value or the wrong numbers,
    0.0 for a malformed one (info["valid"] False; the episode goes on). Division is exact (fractions). With
    max_turns > 1 a wrong answer is shown with its value and the agent may try again; each attempt then pays the
    change in score, so the return is the last attempt's score (wrong, then right: 0.1 + 0.9), never more for
    guessing wrong first.

        observation:  Numbers: 3 5 7 / Target: 22
        reply:        <think> numbers 3 5 7 target 22 ; 3*5=15 , 15+7=22 </think> <answer> (3*5)+7 </answer>
        feedback:     reward 1.0, done
    """
    name = "countdown"
    reply_tokens = 64  # its expert replies run to about 45 tokens
    instruction = ("Use each given number exactly once with + - * / and parentheses to make the target. "
                   "Answer with the expression only, e.g. (3+5)*2.")

    def __init__(self, max_turns=1):
        self.max_turns = max_turns

    def reset(self, seed):
        rng = random.Random(seed)
        while True:  # combine random pairs until one number is left: that is the target
            self.numbers = [rng.randint(1, 12) for _ in range(rng.choice((3, 4)))]
            pool, plan = [(n, str(n)) for n in self.numbers], []
            while len(pool) > 1:
                (a, text_a), (b, text_b) = pool.pop(rng.randrange(len(pool))), pool.pop(rng.randrange(len(pool)))
                if a < b:
                    (a, text_a), (b, text_b) = (b, text_b), (a, text_a)
                op = rng.choice("+-*/")
                op = op if (op != "-" or a > b) and (op != "/" or a % b == 0) else "+"
                result = {"+": a + b, "-": a - b, "*": a * b, "/": a // b}[op]
                plan.append(f"{a}{op}{b}={result}")
                pool.append((result, f"({text_a}{op}{text_b})"))
            if 1 <= pool[0][0] <= 100:
                break
        self.target, self.solution, self.plan = pool[0][0], pool[0][1][1:-1], plan
        self.attempts, self.score, self.last, self.done, self.success = 0, 0.0, "", False, False
        return self.render()

    def render(self):
        return f"Numbers: {' '.join(map(str, self.numbers))}\nTarget: {self.target}" + self.last

    def step(self, action):
        obs, reward, done, info = super().step(action)
        return obs, (reward if info["valid"] else 0.0), done, info  # Countdown's rule: malformed earns 0

    def _apply(self, action):
        parsed = countdown_value(action)
        if parsed is None:
            return None
        value, used = parsed
        right_numbers = sorted(used) == sorted(self.numbers)
        self.attempts += 1
        self.success = right_numbers and value == self.target
        self.done = self.success or self.attempts >= self.max_turns
        shown = "undefined" if value is None else value
        self.last = f"\nLast: {action} = {shown}" + ("" if right_numbers else " (wrong numbers)")
        before, self.score = self.score, 1.0 if self.success else 0.1
        return self.score - before  # the change in score: a return of 1.0 at most, however many attempts

    def expert(self):
        think = f"numbers {' '.join(map(str, self.numbers))} target {self.target} ; {' , '.join(self.plan)}"
        return think, self.solution


# ----------------------------------------------------------------------------------------------------------------
# WebShop (toy)

TYPES = ["shirt", "shoes", "hat", "bag", "jacket", "socks"]
COLORS = ["red", "blue", "black", "white", "green"]
SIZES = ["S", "M", "L"]


class WebShop(Env):
    """A tiny shop: search the catalog, open an item, buy it.

    Pages: search -> results (search[words] from any page) -> item (click[id]) -> buy (click[buy]) or
    click[back] / click[back to search]. Buying ends the episode with reward = fraction of the 4 requested
    attributes (type, color, size, price under the cap) the bought item has; 1.0 only for the target item.

        observation:  Goal: blue shirt, size M, under $40 / Page: search
        reply:        <think> want blue shirt, size M, under $40 ; search for it </think>
                      <answer> search[blue shirt M] </answer>
        feedback:     Goal: ... / Results: p42 blue shirt size M $35 ; p17 blue shirt size M $55 ; ...
    """
    name = "webshop"
    reply_tokens = 64  # its expert replies run to about 45 tokens
    instruction = ("Buy the item described by the goal. Actions: search[words] lists items, click[item id] opens "
                   "one, then click[buy] buys it or click[back] returns; buying ends the episode.")

    def __init__(self, n_items=8, max_turns=5):
        self.n_items, self.max_turns = n_items, max_turns
        # at most 60: a reset redraws the catalogue until only the target matches the goal, which takes ~0.9^-n draws
        _need(_whole(n_items) and 1 <= n_items <= 60, f"n_items must be an integer in [1, 60], got {n_items!r}")
        _need(not _whole(max_turns) or max_turns >= 3, "webshop needs max_turns >= 3 (search, click the item, click buy: "
              f"the item's id shows only after the search), got {max_turns!r}")

    def reset(self, seed):
        rng = random.Random(seed)
        while True:
            ids = [f"p{n}" for n in rng.sample(range(10, 100), self.n_items)]
            target = {"type": rng.choice(TYPES), "color": rng.choice(COLORS), "size": rng.choice(SIZES),
                      "price": rng.randint(5, 59)}
            self.target, self.cap = target, target["price"] // 10 * 10 + 10
            items = [target]
            for _ in range(self.n_items - 1):  # distractors: the target with one or two attributes changed
                item = dict(target)
                for key in rng.sample(list(target), rng.randint(1, 2)):
                    options = {"type": TYPES, "color": COLORS, "size": SIZES}.get(key)
                    item[key] = rng.choice(options) if options else rng.randint(self.cap, self.cap + 40)
                items.append(item)
            if sum(self._matches(item) == 4 for item in items) == 1:
                break
        rng.shuffle(items)
        for item, item_id in zip(items, ids):
            item["id"] = item_id
        self.items = items
        self.goal = f"{target['color']} {target['type']}, size {target['size']}, under ${self.cap}"
        self.page, self.results, self.item = "search", [], None
        self.done = self.success = False
        return self.render()

    def _matches(self, item):
        want = self.target
        return (sum(item[k] == want[k] for k in ("type", "color", "size")) + (item["price"] < self.cap))

    @staticmethod
    def _describe(item):
        return f"{item['id']} {item['color']} {item['type']} size {item['size']} ${item['price']}"

    def _search(self, query):
        words = set(re.findall(r"[a-z0-9]+", query.lower()))
        scored = [(sum(item[k].lower() in words for k in ("type", "color", "size")), item) for item in self.items]
        hits = sorted((s for s in scored if s[0] > 0), key=lambda s: (-s[0], s[1]["price"], s[1]["id"]))
        return [item for _, item in hits[:5]]

    def render(self):
        lines = [f"Goal: {self.goal}"]
        if self.done:
            lines.append(f"Bought {self._describe(self.item)}")
        elif self.page == "search":
            lines.append("Page: search")
        elif self.page == "results":
            lines.append("Results: " + (" ; ".join(map(self._describe, self.results)) or "none"))
        else:
            lines.append(f"Item: {self._describe(self.item)} | buttons: buy, back, back to search")
        return "\n".join(lines)

    def _apply(self, action):
        found = re.fullmatch(r"(search|click)\[(.*)\]", action, re.IGNORECASE | re.ASCII | re.DOTALL)  # ASCII: no "ſearch"
        if found is None:
            return None
        verb, arg = found.group(1).lower(), found.group(2).strip().lower()
        if verb == "search" and arg:
            self.page, self.results = "results", self._search(arg)
        elif verb == "search":
            return None
        elif arg == "back to search":
            self.page = "search"
        elif arg == "back" and self.page == "item":
            self.page = "results"
        elif arg == "buy" and self.page == "item":
            self.done, self.success = True, self.item is self.target
            return self._matches(self.item) / 4
        elif self.page == "results" and arg in [item["id"] for item in self.results]:
            self.page, self.item = "item", next(item for item in self.results if item["id"] == arg)
        else:
            return None
        return 0.0

    def expert(self):
        want = f"want {self.goal}"
        if self.page == "item":
            ok = self.item is self.target
            return (f"{want} ; page shows {self._describe(self.item)} ; {'match' if ok else 'no match'}",
                    "click[buy]" if ok else "click[back]")
        if self.page == "results" and self.target in self.results:
            return f"{want} ; {self._describe(self.target)} matches", f"click[{self.target['id']}]"
        t = self.target
        return f"{want} ; search for it", f"search[{t['color']} {t['type']} {t['size']}]"


# ----------------------------------------------------------------------------------------------------------------
# CodeExec (toy): a one-expression function body, run by a small interpreter with hard limits

MAX_CODE_CHARS, MAX_NODES, MAX_STEPS, MAX_INT, MAX_LIST = 300, 100, 10_000, 10**12, 1000


class SandboxLimit(Exception):
    """The code went past a limit of the interpreter (size of a number or list, number of steps)."""


def _sized(value):
    """Every value must be an int with |v| <= MAX_INT or a flat list of at most MAX_LIST ints."""
    if isinstance(value, list):
        if len(value) > MAX_LIST or any(isinstance(v, list) for v in value):
            raise SandboxLimit("lists hold at most MAX_LIST ints")  # nested lists could share exponentially
    elif abs(value) > MAX_INT:
        raise SandboxLimit("int too large")
    return value


def _mul(a, b):
    items, n = (a, b) if isinstance(a, list) else (b, a)
    if isinstance(items, list) and isinstance(n, int) and n * len(items) > MAX_LIST:
        raise SandboxLimit("list too long")  # refused before the list is built
    return a * b


CODE_BUILTINS = {"len": len, "sum": lambda xs: sum(xs),  # one argument: no sum(lists, []) building huge lists
                 "min": min, "max": max, "abs": abs, "sorted": sorted}
_BIN = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: _mul, ast.FloorDiv: operator.floordiv,
        ast.Mod: operator.mod}
_CMP = {ast.Eq: operator.eq, ast.NotEq: operator.ne, ast.Lt: operator.lt, ast.LtE: operator.le,
        ast.Gt: operator.gt, ast.GtE: operator.ge, ast.In: lambda a, b: a in b, ast.NotIn: lambda a, b: a not in b}
_CODE_NODES = (ast.Expression, ast.Constant, ast.Name, ast.Load, ast.List, ast.BinOp, ast.UnaryOp, ast.USub,
               ast.Compare, ast.IfExp, ast.Subscript, ast.Slice, ast.Call, *_BIN, *_CMP)


def parse_code(text):
    """Parse a model's expression, or None if it uses anything outside the whitelist.

    Allowed: int constants, the name x, lists, arithmetic (+ - * // %), comparisons, `a if c else b`,
    indexing and slicing, and calls of CODE_BUILTINS by name with positional arguments. Nothing else: no
    attributes, strings, lambdas, comprehensions, imports or keyword arguments (so no loops either).
    """
    tree = _parse_expression(text, _CODE_NODES, MAX_CODE_CHARS, MAX_NODES)
    if tree is None:
        return None
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and type(node.value) is not int:
            return None
        if isinstance(node, ast.Name) and node.id != "x" and node.id not in CODE_BUILTINS:
            return None
        if isinstance(node, ast.Call) and (node.keywords or not isinstance(node.func, ast.Name)
                                           or node.func.id not in CODE_BUILTINS):
            return None
    return tree


def run_code(tree, x):
    """Evaluate a parsed expression with the input bound to `x`. Raises SandboxLimit or an ordinary error."""
    steps = 0

    def ev(node):
        nonlocal steps
        value = _sized(_eval(node))
        steps += 1 + (len(value) if isinstance(value, list) else 0)  # a list costs one step per element
        if steps > MAX_STEPS:
            raise SandboxLimit("too many steps")
        return value

    def _eval(node):
        if isinstance(node, ast.Constant):
            return node.value
        if isinstance(node, ast.Name):
            if node.id != "x":
                raise NameError(f"{node.id} can only be called")
            return x
        if isinstance(node, ast.List):
            return [ev(e) for e in node.elts]
        if isinstance(node, ast.BinOp):
            return _BIN[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp):
            return -ev(node.operand)
        if isinstance(node, ast.Compare):
            left = ev(node.left)
            for op, right_node in zip(node.ops, node.comparators):
                right = ev(right_node)
                if not _CMP[type(op)](left, right):
                    return False
                left = right
            return True
        if isinstance(node, ast.IfExp):
            return ev(node.body) if ev(node.test) else ev(node.orelse)
        if isinstance(node, ast.Subscript):
            if isinstance(node.slice, ast.Slice):
                s = node.slice
                return ev(node.value)[slice(*[None if p is None else ev(p) for p in (s.lower, s.upper, s.step)])]
            return ev(node.value)[ev(node.slice)]
        if isinstance(node, ast.Call):
            return CODE_BUILTINS[node.func.id](*[ev(a) for a in node.args])
        raise SandboxLimit(f"unsupported {type(node).__name__}")

    return ev(tree)


def _code_task(rng):
    """A task from one of six families: (family, input kind, what to return, expert expression, reference)."""
    a, b, k = rng.randint(2, 5), rng.randint(0, 9), rng.randint(1, 9)
    return rng.choice([
        ("linear", "int", f"{a} times x plus {b}", f"x*{a}+{b}", lambda x: a * x + b),
        ("clip", "int", f"x, but at most {k}", f"min(x, {k})", lambda x: min(x, k)),
        ("largest", "list", "its largest element", "max(x)", max),
        ("reverse", "list", "it reversed", "x[::-1]", lambda x: x[::-1]),
        ("head_sum", "list", f"the sum of its first {a} elements", f"sum(x[:{a}])", lambda x: sum(x[:a])),
        ("span", "list", "its largest minus its smallest element", "max(x)-min(x)", lambda x: max(x) - min(x)),
    ])


class CodeExec(Env):
    """Write a function body as ONE Python expression over the input `x`; it is run on hidden tests.

    The expression is parsed with ast, checked against a whitelist (see parse_code) and run by our own
    interpreter with limits (never eval/exec). A refused expression is an invalid action. Each attempt's
    reward is the change in the fraction of tests passed, so an episode's return is the fraction passed by the
    last attempt. Done when all pass or after max_turns attempts. The Example is an input outside the tests. After an
    attempt, two failing tests' inputs and what the expression gave are shown, not the values it should give: else a
    table of the answers seen (`7 if x == [6, 1, 4] else ...`) would pass the hidden tests without solving the task.

        observation:  Task: x is a list of ints; return the sum of its first 2 elements
                      Example: f([6, 1, 4]) = 7
        reply:        <think> head_sum task: return the sum of its first 2 elements ; write sum(x[:2]) </think>
                      <answer> sum(x[:2]) </answer>
        feedback:     the same two lines, then "Passed 4/4"   (reward 1.0, done)
        (after x[0]:  "Passed 1/4; failing: f([2, 5]) gave 2 ; f([3, 3]) gave 3", reward 0.25)
    """
    name = "code"
    reply_tokens = 64  # its expert replies run to about 35 tokens
    instruction = ("Write the body of f(x) as one Python expression over x: ints, lists, + - * // %, comparisons, "
                   "a if c else b, indexing, slicing and len sum min max abs sorted. "
                   "Answer with the expression only.")

    def __init__(self, max_turns=3, n_tests=4):
        self.max_turns, self.n_tests = max_turns, n_tests
        _need(_whole(n_tests) and 1 <= n_tests <= 100, f"n_tests must be an integer in [1, 100], got {n_tests!r}")

    def reset(self, seed):
        rng = random.Random(seed)
        self.family, kind, self.goal, self.solution, reference = _code_task(rng)
        self.description = f"x is {'an int' if kind == 'int' else 'a list of ints'}; return {self.goal}"
        draw = lambda: rng.randint(-20, 20) if kind == "int" else [rng.randint(0, 20) for _ in range(rng.randint(1, 6))]
        inputs = [draw() for _ in range(self.n_tests)]
        self.tests = [(x, reference(x)) for x in inputs]
        x = next((x for x in (draw() for _ in range(1000)) if x not in inputs), 21 if kind == "int" else [21])
        self.example = (x, reference(x))  # shown, never scored: an answer copied from it passes no test
        self.attempts, self.passed, self.feedback = 0, 0.0, ""
        self.done = self.success = False
        return self.render()

    def render(self):
        x, y = self.example
        return f"Task: {self.description}\nExample: f({x}) = {y}" + self.feedback

    def _apply(self, action):
        tree = parse_code(action)
        if tree is None:
            return None
        failing = []
        for x, want in self.tests:
            try:
                got = run_code(tree, x)
            except Exception:  # noqa: BLE001 -- any error inside the sandboxed program fails that test
                got = "error"
            if got != want:
                failing.append(f"f({x}) gave {str(got)[:30]}")  # not the expected value: the tests stay hidden
        before, self.passed = self.passed, 1 - len(failing) / len(self.tests)
        self.attempts += 1
        self.success = not failing
        self.done = self.success or self.attempts >= self.max_turns
        self.feedback = f"\nPassed {len(self.tests) - len(failing)}/{len(self.tests)}" + \
            (f"; failing: {' ; '.join(failing[:2])}" if failing else "")
        return self.passed - before

    def expert(self):
        return f"{self.family} task: return {self.goal} ; write {self.solution}", self.solution


# ----------------------------------------------------------------------------------------------------------------
# Registry

ENVS = {
    "frozenlake": FrozenLake,
    "frozenlake-mixed": frozenlake_mixed,
    "bandit": Bandit,
    "sokoban": Sokoban,
    "countdown": Countdown,
    "webshop": WebShop,
    "code": CodeExec,
}


MAX_TURNS = 100  # the most turns an episode may have (any env)


def make_env(name, format_penalty=None, max_turns=None, **kwargs):
    """Build a registered environment by name, e.g. make_env("sokoban", max_turns=8). `format_penalty` (any env)
    is the reward of a malformed reply or an invalid action (default `Env.format_penalty`); 0 makes a group that
    never succeeds have zero spread. `max_turns` (any env) is its turn limit; None keeps the env's own."""
    if name not in ENVS:
        raise ValueError(f"unknown env {name!r}; choose from: {', '.join(ENVS)}")
    env = ENVS[name](**kwargs, **({} if max_turns is None else {"max_turns": max_turns}))
    _need(_whole(env.max_turns) and 1 <= env.max_turns <= MAX_TURNS, f"max_turns must be an integer in "
          f"[1, {MAX_TURNS}] (the whole conversation is one sequence), got {env.max_turns!r}")
    if format_penalty is not None:
        _need(_real(format_penalty) and math.isfinite(format_penalty), f"format_penalty must be a finite number, got {format_penalty!r}")
        env.format_penalty = float(format_penalty)
    return env
