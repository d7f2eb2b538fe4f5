"""Multi-turn episodes in TextGenEnv / TextGenVectorEnv: layout, masks, rewards, limits and clear errors."""

import math
import re

import gymnasium
import numpy as np
import pytest
from gymnasium.vector import AutoresetMode

import textgym
from textgym import Reply, TextGenEnv, TextGenVectorEnv, plugin_info, plugin_manager
from textgym.errors import ConfigError, PluginArgumentError, UnknownNameError
from textgym.models import CharTokenizer
from textgym.responders import ResponderError, make_responder

CHARS = CharTokenizer("abcdefgh")
EOS = CHARS.eos_token_id


def ids(text):
    return CHARS.encode(text)


def named(fn, name=None, role="user"):
    fn.name, fn.role = name or fn.__name__, role
    return fn


def say(text, reward=None, done_after=None):
    """A responder that always says ``text`` (and ends the episode after ``done_after`` agent turns)."""

    def respond(conversations):
        return [
            Reply(text, reward, done_after is not None and c.agent_turns >= done_after) for c in conversations
        ]

    return named(respond, "say")


class Recorder:
    """A reward that keeps the samples it scored."""

    name = "recorder"

    def __init__(self):
        self.samples = []

    def __call__(self, samples):
        self.samples.extend(samples)
        return [float(len(s.turns)) for s in samples]


def char_env(responder, **kwargs):
    defaults = dict(model=CHARS, prompts=["ab"], rewards=[], max_new_tokens=12, max_prompt_tokens=2)
    return TextGenEnv(responder=responder, **{**defaults, **kwargs})


def run(env, actions):
    """Step ``actions``; return the last step's outputs and every non-empty info."""
    infos = []
    for a in actions:
        out = env.step(a)
        if out[4]:
            infos.append(out[4])
        if out[2] or out[3]:
            break
    return out, infos


def test_a_reply_becomes_observation_tokens_marked_in_info_with_the_turn_reward_on_the_turn_end():
    recorder = Recorder()
    env = char_env(say("cd", reward=0.5, done_after=2), rewards=textgym.RewardStack([(recorder, 1.0)]))
    obs, _ = env.reset(seed=0)
    obs, reward, terminated, truncated, info = env.step(ids("e")[0])
    assert (reward, terminated, truncated, info) == (0.0, False, False, {})
    obs, reward, terminated, truncated, info = env.step(EOS)  # end of the agent's first turn
    assert (reward, terminated, truncated) == (0.5, False, False) and info["turn_reward"] == 0.5
    # prompt "ab" | e <eos> | c d (the reply, observation tokens) | ...
    assert obs["input_ids"][2:6].tolist() == [*ids("e"), EOS, *ids("cd")]
    assert obs["attention_mask"][2:6].tolist() == [1, 1, 1, 1]
    assert info["env_token_mask"].tolist() == [0, 0, 0, 0, 1, 1] + [0] * 8
    (obs, reward, terminated, truncated, info), _ = run(env, [*ids("f"), EOS])
    assert terminated and not truncated and info["finish_reason"] == "stop"
    assert reward == pytest.approx(0.5 + 3.0)  # the last turn's reward plus the stack's total (3 turns)
    assert info["turns"] == [
        {"role": "assistant", "text": "e", "tokens": 2}, {"role": "user", "text": "cd", "tokens": 2},
        {"role": "assistant", "text": "f", "tokens": 2},  # tokens: "f" and EOS
    ]  # fmt: skip
    assert info["turn_rewards"] == [0.5, 0.5] and info["num_tokens"] == 4 and info["completion"] == "f"
    sample = recorder.samples[-1]  # the stack scores the whole conversation
    assert [(t.role, t.text, t.token_ids) for t in sample.turns] == [
        ("assistant", "e", (*ids("e"), EOS)), ("user", "cd", tuple(ids("cd"))), ("assistant", "f", (*ids("f"), EOS)),
    ]  # fmt: skip
    assert sample.completion == "f" and sample.completion_ids == (*ids("f"), EOS)


def test_replies_are_batched_over_the_episodes_whose_turns_end_on_the_same_step():
    batches = []

    def counting(conversations):
        batches.append([c.last for c in conversations])
        return ["a"] * len(conversations)

    env = TextGenVectorEnv(
        num_envs=3, model=CHARS, prompts=["ab"], rewards=[], max_new_tokens=10, max_prompt_tokens=2,
        responder=named(counting), autoreset_mode="Disabled",
    )  # fmt: skip
    env.reset(seed=0)
    env.step(np.array([EOS, 3, EOS]))  # sub-envs 0 and 2 end a turn together
    env.step(np.array([2, EOS, 2]))
    assert batches == [["", ""], ["b"]]
    _, _rewards, _, _, infos = env.step(np.array([EOS, 2, 2]))
    assert infos["_turn_reward"].tolist() == [True, False, False] and infos["env_token_mask"].shape == (3, 12)


def test_max_turns_bounds_every_episode_and_the_responder_knows_the_last_turn():
    seen = []

    def chatty(conversations):
        seen.extend((c.agent_turns, c.last_turn) for c in conversations)
        return [Reply("c", reward=1.0) for c in conversations]  # never ends the episode itself

    env = char_env(named(chatty), max_turns=2, max_new_tokens=20)
    env.reset(seed=0)
    (obs, reward, terminated, truncated, info), _ = run(env, [EOS] * 10)
    assert (terminated, truncated, info["finish_reason"]) == (True, True, "max_turns")
    assert seen == [(1, False), (2, True)] and reward == 1.0 and info["turn_rewards"] == [1.0, 1.0]
    assert obs["attention_mask"].sum() == 2 + 3  # the last reply is not shown


def test_a_reply_that_overflows_the_token_budget_is_cut_and_ends_the_episode():
    env = char_env(say("abcdefgh"), max_new_tokens=6)
    obs, _ = env.reset(seed=0)
    (obs, _, terminated, truncated, info), _ = run(env, [*ids("h"), EOS])
    assert (terminated, truncated, info["finish_reason"]) == (True, True, "overflow")
    assert obs["input_ids"][2:].tolist() == [*ids("h"), EOS, *ids("abcd")]  # cut at the budget
    assert info["turns"][-1] == {
        "role": "user",
        "text": "abcd",
        "tokens": 4,
    }  # what was written, as the agent saw it
    # a reply that fits exactly leaves no room for the agent: also an overflow
    env = char_env(say("ab"), max_new_tokens=4)
    env.reset(seed=0)
    assert run(env, [*ids("h"), EOS])[0][4]["finish_reason"] == "overflow"


def test_the_agent_turn_cut_at_the_budget_is_a_length_end_and_the_completion():
    env = char_env(say("cd"), max_new_tokens=6)
    env.reset(seed=0)
    (_, _, terminated, truncated, info), _ = run(env, [EOS, *ids("eeee")])
    assert (terminated, truncated, info["finish_reason"], info["completion"]) == (
        True,
        True,
        "length",
        "eee",
    )


def test_stop_strings_end_agent_turns_but_not_inside_the_environments_reply():
    env = char_env(say("hh", done_after=2), stop=["hh"], max_new_tokens=14)
    env.reset(seed=0)
    (obs, _, terminated, truncated, info), infos = run(env, [*ids("ahh")])
    assert infos[-1]["turn_reward"] == 0.0 and not (terminated or truncated)
    assert obs["input_ids"][2:7].tolist() == ids("ahhhh")  # agent "ahh" (stop string), env "hh"
    (_, _, terminated, _, info), _ = run(env, [*ids("a"), EOS])  # "hh" + "a" must not count as a stop
    assert terminated and [t["text"] for t in info["turns"]] == ["ahh", "hh", "a"]
    # a last agent turn ended by the stop string: its text is "a", its tokens "ahh"
    recorder = Recorder()
    env = char_env(say("hh", done_after=1), stop=["hh"], max_new_tokens=14, rewards=[(recorder, 1.0)])
    env.reset(seed=0)
    (_, _, terminated, _, info), _ = run(env, [*ids("ahh")])
    sample = recorder.samples[-1]
    assert terminated and (sample.completion, sample.completion_ids, sample.stop_tokens) == (
        "a",
        tuple(ids("ahh")),
        2,
    )


def test_the_chat_template_formats_replies_with_the_responders_role(tokenizer):
    env = TextGenEnv(
        model="smollm2-135m-instruct", prompts=["Hi"], rewards=[], responder=say("= 4"), max_new_tokens=48
    )
    env.episodes.responder.role = "tool"
    obs, _ = env.reset(seed=0)
    agent = tokenizer.encode("2+2", add_special_tokens=False)
    (obs, *_), _ = run(env, [*agent, tokenizer.eos_token_id])
    text = tokenizer.decode(obs["input_ids"][obs["attention_mask"] == 1])
    assert text.endswith(
        "<|im_start|>assistant\n2+2<|im_end|>\n<|im_start|>tool\n= 4<|im_end|>\n<|im_start|>assistant\n"
    )
    # a turn ended by a stop string: the env writes the end of the agent's message
    env = TextGenEnv(
        model="smollm2-135m-instruct", prompts=["Hi"], rewards=[], responder=say("ok"), stop=["</calc>"],
        max_new_tokens=48,
    )  # fmt: skip
    env.reset(seed=0)
    (obs, _, _, _, info), _ = run(env, tokenizer.encode("<calc>1</calc>", add_special_tokens=False))
    P = env.max_prompt_tokens
    env_ids = obs["input_ids"][P:][info["env_token_mask"][P:] == 1]
    assert tokenizer.decode(env_ids) == "<|im_end|>\n<|im_start|>user\nok<|im_end|>\n<|im_start|>assistant\n"
    # a stop string that is the end marker's first characters, not its token: the marker was taken as written,
    # and its rest ("|im_end|>") written as text tokens, never closing the message
    env = TextGenEnv(model="smollm2-135m-instruct", prompts=["Hi"], rewards=[], responder=say("ok"), stop=["<"],
                     max_new_tokens=48)  # fmt: skip
    env.reset(seed=0)
    (obs, _, _, _, info), _ = run(env, tokenizer.encode("x <", add_special_tokens=False))
    env_ids = obs["input_ids"][P:][info["env_token_mask"][P:] == 1]
    assert env_ids[0] == tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert tokenizer.decode(env_ids).startswith("<|im_end|>\n<|im_start|>user\nok")


def test_a_responder_that_raises_or_returns_a_non_string_names_itself():
    def secret(conversation):
        return conversation.meta["secret"]

    def broken(conversations):
        return [secret(c) for c in conversations]

    env = char_env(named(broken, "broken"))
    env.reset(seed=0)
    line = secret.__code__.co_firstlineno + 1  # the helper that raised: the one-line error named no place
    with pytest.raises(
        ResponderError,
        match=rf"responder 'broken' raised KeyError \(at .*test_multiturn_envs.py:{line} in secret\): 'secret'",
    ):
        env.step(EOS)
    for bad, pattern in [
        (lambda cs: [42 for _ in cs], r"responder 'bad' returned int 42 for conversation 0"),
        (lambda cs: [Reply(None) for _ in cs], r"responder 'bad' returned NoneType None"),
        (lambda cs: [], r"responder 'bad' returned 0 replies for 1 conversations"),
        (lambda cs: "hi", r"responder 'bad' returned str 'hi'"),
        (lambda cs: [Reply("a", reward=float("nan"))], r"responder 'bad' returned reward nan"),
        # an int past float's range raised a bare OverflowError, naming no responder
        (lambda cs: [Reply("a", reward=10**400)], r"'bad' returned reward an int past float's range"),
        # an empty role was taken as the responder's own
        (lambda cs: [Reply("a", role="")], r"'bad' replied with role '' "),
        # a truncated reply that goes on was ignored; an "assistant" reply counted as the agent's turn (its
        # text could become the scored completion)
        (lambda cs: [Reply("a", truncated=True)], r"'bad' returned truncated=True without done=True"),
        (
            lambda cs: [Reply("a", role="assistant")],
            r"'bad' replied with role 'assistant' .*never the agent's",
        ),
    ]:
        env = char_env(named(bad, "bad"))
        env.reset(seed=0)
        with pytest.raises(ResponderError, match=pattern):
            env.step(EOS)
    # a responder's own role is checked when the env is made (it was at its first reply, mid-training)
    with pytest.raises(ConfigError, match=r"responder 'bad' has role 'assistant'; .*never the agent's"):
        char_env(named(lambda cs: ["a" for _ in cs], "bad", role="assistant"))


def test_a_step_that_raised_must_be_followed_by_a_reset():
    """The agent's turn was recorded before the responder raised: a caller that caught the error and stepped
    on got a conversation without the reply, and past max_turns without an end."""
    calls = []

    def flaky(conversations):
        calls.append(len(conversations))
        if len(calls) == 1:
            raise RuntimeError("timeout")
        return ["a" for _ in conversations]

    env = char_env(named(flaky, "flaky"), max_turns=2)
    env.reset(seed=0)
    with pytest.raises(ResponderError, match="raised RuntimeError"):
        env.step(EOS)
    with pytest.raises(gymnasium.error.ResetNeeded, match="or a step of it raised"):
        env.step(EOS)
    env.reset(seed=0)
    (_, _, _, truncated, info), _ = run(env, [EOS, EOS])
    assert truncated and info["finish_reason"] == "max_turns" and len(info["turns"]) == 3

    calls.clear()
    vec = TextGenVectorEnv(num_envs=2, responder=named(flaky, "flaky"), max_turns=2, model=CHARS, prompts=["ab"],
                           rewards=[], max_new_tokens=12, max_prompt_tokens=2)  # fmt: skip
    vec.reset(seed=0)
    with pytest.raises(ResponderError):
        vec.step(np.array([EOS, EOS]))
    vec.reset(options={"reset_mask": np.array([True, False])})  # the other sub-env is still half-done
    with pytest.raises(gymnasium.error.ResetNeeded, match="call reset\\(\\) \\(of every sub-env\\)"):
        vec.step(np.array([EOS, EOS]))
    vec.reset(seed=0)
    vec.step(np.array([EOS, EOS]))
    _, _, _, truncated, _ = vec.step(np.array([EOS, EOS]))
    assert truncated.all()


def test_a_reset_whose_opening_raised_must_be_followed_by_a_reset():
    """A responder's start() raised after the slot held the new prompt but the observation the old one: a
    caller that caught the error and stepped on wrote into the old episode and scored it as the new prompt."""

    class Opener:
        name, role, fail = "opener", "user", False

        def start(self, conversations):
            if self.fail:
                raise RuntimeError("server down")
            return ["c" for _ in conversations]

        def __call__(self, conversations):
            return ["d" for _ in conversations]

    opener = Opener()
    env = char_env(opener, prompts=["ab", "hh"])
    env.reset(seed=0, options={"prompt": 0})
    env.step(ids("e")[0])  # mid-episode
    opener.fail = True
    with pytest.raises(ResponderError, match="raised RuntimeError in start"):
        env.reset(seed=1, options={"prompt": 1})
    with pytest.raises(gymnasium.error.ResetNeeded):
        env.step(ids("e")[0])
    opener.fail = False
    env.reset(seed=1, options={"prompt": 1})
    env.step(ids("e")[0])

    vec = TextGenVectorEnv(num_envs=2, responder=opener, model=CHARS, prompts=["ab", "hh"], rewards=[],
                           max_new_tokens=12, max_prompt_tokens=2)  # fmt: skip
    vec.reset(seed=0)
    opener.fail = True
    with pytest.raises(ResponderError):
        vec.reset(options={"reset_mask": np.array([True, False])})
    with pytest.raises(gymnasium.error.ResetNeeded, match="a step or reset raised"):
        vec.step(np.array([EOS, EOS]))
    opener.fail = False
    vec.reset(seed=1)
    vec.step(np.array([EOS, EOS]))


def test_a_responder_object_without_a_name_is_refused_not_stripped_of_its_methods():
    """It was wrapped as a plain function: its role, opening (start) and end were dropped without a word."""
    from textgym.responders import make_responder

    class Game:
        role = "tool"

        def start(self, conversations):
            return ["Guess." for _ in conversations]

        def __call__(self, conversations):
            return ["a" for _ in conversations]

    with pytest.raises(ConfigError, match=r"has role, start but no 'name'.*`name` attribute"):
        make_responder(Game())
    Game.name = "game"
    assert make_responder(Game()).role == "tool"


def test_a_responder_class_passed_for_an_instance_is_refused_with_what_to_pass():
    """It was accepted: its start() then failed for want of self, and a text env class's reset was skipped
    until the first turn's reply came back as an instance of it."""
    from textgym.responders import make_responder

    class Shout:
        name = "shout"

        def __call__(self, conversations):
            return ["!" for _ in conversations]

    class Wordle:
        def reset(self, seed=None):
            return "Guess.", {}

        def step(self, action):
            return "ok", 0.0, True, False, {}

    class Counter:
        def reset(self, **kwargs):
            return "Count."

        def add(self, n: int) -> str:
            return str(n)

    with pytest.raises(ConfigError, match=r"responder Shout is a class, not a responder: pass an instance"):
        make_responder(Shout)
    with pytest.raises(ConfigError, match=r"responder Wordle is a class.*TextEnvResponder\(Wordle\)"):
        make_responder(Wordle)
    with pytest.raises(ConfigError, match=r"responder Counter is a class.*ToolEnvResponder\(Counter\)"):
        make_responder(Counter)
    assert make_responder(Shout()).name == "shout"


def test_a_reply_the_tokenizer_cannot_encode_names_the_responder():
    env = char_env(say("Higher!"))
    env.reset(seed=0)
    with pytest.raises(ResponderError, match=r"responder 'say' replied 'Higher!', which the env's tokenizer"):
        env.step(EOS)


def test_bad_multi_turn_arguments_are_clear_errors():
    with pytest.raises(
        UnknownNameError, match=r"unknown responder 'calculater'. Did you mean 'calculator'\?"
    ):
        char_env("calculater")
    with pytest.raises(UnknownNameError, match=r"Known responders: .*echo.*guess_number.*user_simulator"):
        char_env({"name": "nope"})
    with pytest.raises(ConfigError, match=r"max_turns must be a positive integer or None"):
        char_env(say("a"), max_turns=0)
    with pytest.raises(ConfigError, match=r"max_turns=3 needs a responder"):
        TextGenEnv(model=CHARS, prompts=["ab"], max_turns=3)
    with pytest.raises(ConfigError, match=r"exactly one of 'name' .*'text_env' or 'tool_env'"):
        char_env({"tool_env": "x.py:Tools", "text_env": "x.py:Game"})
    with pytest.raises(textgym.errors.PluginArgumentError, match=r"responder 'echo' got unknown argument"):
        char_env({"name": "echo", "partail": True})
    with pytest.raises(
        ConfigError, match=r"'test_multiturn_envs' has no class 'Counterr'. Classes there: .*Counter"
    ):
        char_env({"tool_env": "test_multiturn_envs:Counterr"})


def test_without_a_responder_episodes_are_single_turn_as_before():
    env = TextGenEnv(model=CHARS, prompts=["ab"], rewards=textgym.RewardStack([(Recorder(), 1.0)]))
    env.reset(seed=0)
    (_, reward, terminated, _, info), _infos = run(env, [*ids("c"), EOS])
    assert terminated and "turns" not in info and "env_token_mask" not in info and reward == 0.0
    assert env.env_token_mask.sum() == 0 and env.max_turns is None and env.responder is None


# -- the built-in responders ----------------------------------------------------------------------------
def test_calculator_parses_arithmetic_itself():
    from textgym.plugins.calculator import CalcError, evaluate, format_number

    for expression, value in [
        ("2 + 3 * 4", "14"), ("(2 + 3) * 4", "20"), ("-3 - -2", "-1"), ("7 / 2", "3.5"), ("1 / 3", "≈0.3333333333"),
        # exact where the decimal is finite: float's 10 digits gave "1000000002" and "1e+11", as if exact
        ("2.5 * 400000001", "1000000002.5"), ("100000000000.5", "100000000000.5"), ("-1 / 1024", "-0.0009765625"),
        ("0.1 + 0.2", "0.3"), ("14*12", "168"), ("+(.5)", "0.5"), ("2 * (3 + (4 - 1)) / 3", "4"),
        ("14 + 15 ", "29"), (" ( 1 + 2 ) ", "3"), ("\t7\t", "7"), ("\n8\n", "8"),  # as models space a call
    ]:  # fmt: skip
        assert format_number(evaluate(expression)) == value, expression
    from textgym.plugins.calculator import Calculator
    from textgym.responders import Conversation, Turn

    calls = [Conversation("q", {}, (Turn("assistant", f"<calc>{x}</calc>"),)) for x in ("1/3", "7/2")]
    assert [r.text for r in Calculator()(calls)] == ["≈ 0.3333333333", "= 3.5"]  # a rounded result says so
    for expression, message in [
        ("2 +* 3", "expected a number at position 3"), ("(1 + 2", "expected ')' at the end"),
        ("1 / (2 - 2)", "division by zero"), ("__import__('os')", "unexpected '_' at position 0"),
        ("", "the expression is empty"), ("1 2", "unexpected '2' at position 2"), ("9" * 201, "longer than 200"),
    ]:  # fmt: skip
        with pytest.raises(CalcError, match=re.escape(message)):
            evaluate(expression)


def test_a_malformed_tool_call_is_an_error_message_the_model_reads_and_the_episode_goes_on(tokenizer):
    env = gymnasium.make("textgym/Calculator-v0", prompts="arithmetic").unwrapped
    obs, info = env.reset(seed=0, options={"prompt": 0})
    assert "<calc>expression</calc>" in info["prompt"]  # the calculator's instructions open the episode
    P = env.max_prompt_tokens
    for call, result in [
        ("<calc>2 +* 3</calc>", "error: expected a number at position 3."),
        ("<calc>(14+15</calc>", "error: expected ')' at the end."),
        ("<calc>14+15</calc>", "= 29"),
    ]:
        (obs, reward, terminated, truncated, info), _ = run(
            env, tokenizer.encode(call, add_special_tokens=False)
        )
        assert not (terminated or truncated)
        assert tokenizer.decode(obs["input_ids"][P:][info["env_token_mask"][P:] == 1]).endswith(
            f"<|im_start|>tool\n{result}<|im_end|>\n<|im_start|>assistant\n"
        )
    (obs, reward, terminated, truncated, info), _ = run(
        env, [*tokenizer.encode("29", add_special_tokens=False), 2]
    )
    assert (
        terminated
        and info["completion"] == "29"
        and reward == 1.0
        and info["reward_components"] == {"match": 1.0}
    )
    assert [t["role"] for t in info["turns"]] == ["assistant", "tool"] * 3 + ["assistant"]


def test_guess_number_gives_feedback_every_turn_and_pays_for_few_turns():
    from textgym.plugins.guess_number import GuessNumber
    from textgym.responders import Conversation, Turn

    game = GuessNumber(turn_penalty=0.25)

    def after(*guesses):
        turns = tuple(t for g in guesses for t in (Turn("assistant", g), Turn("user", "")))[:-1]
        return game([Conversation("guess", {"secret": 7}, turns)])[0]

    assert after("5") == Reply("Higher.") and after("My guess is 9") == Reply("Lower.")
    invalid = Reply("Please answer with one whole number.", reward=0.0)
    assert after("seven") == invalid
    assert after("7") == Reply("Correct!", reward=1.0, done=True)
    assert after("5", "9", "7") == Reply("Correct!", reward=0.5, done=True)
    assert textgym.load_prompts("guess_number")[0].meta["secret"] >= 1
    # "7.5" was read as 7 and solved the game; "1e1" as 1; a range's first number as the guess
    assert after("Is it 7.5?") == after("1e1") == after("between 1 and 10: 7") == after("7, 8") == invalid
    assert after("-3") == Reply("Higher.") and after("1,000") == Reply("Lower.")
    # a NaN penalty made every solve score 0 (max(0, nan) is 0); a negative one paid more for later solves
    for bad, match in [({"turn_penalty": math.nan}, "turn_penalty must be a finite number"),
                       ({"solve_reward": "1"}, "solve_reward must be a finite number"),
                       ({"turn_penalty": -0.5}, r"turn_penalty must be >= 0 \(fewer turns pay more\)")]:  # fmt: skip
        with pytest.raises(ValueError, match=match):
            GuessNumber(**bad)
    with pytest.raises(ValueError, match="its 'secret' must be a whole number, not 7.9"):  # it was cut to 7
        game([Conversation("guess", {"secret": 7.9}, (Turn("assistant", "7"),))])
    assert game([Conversation("guess", {"secret": "7"}, (Turn("assistant", "7"),))])[0].done
    big = 2**53 + 1  # read through a float, it was 2**53, and the exact guess got "Lower."
    assert game([Conversation("guess", {"secret": big}, (Turn("assistant", str(big)),))])[0].done


def test_user_simulator_asks_the_follow_ups_in_order_then_ends():
    from textgym.responders import Conversation, Turn

    sim = textgym.make_responder("user_simulator")
    meta = {"followups": ["Why?", "Shorter?"]}
    turns = (Turn("assistant", "A"),)
    assert sim([Conversation("q", meta, turns)])[0] == Reply("Why?")
    turns += (Turn("user", "Why?"), Turn("assistant", "B"), Turn("user", "Shorter?"), Turn("assistant", "C"))
    assert sim([Conversation("q", meta, turns)])[0].done
    for bad in ["Why?", {"Why?": "Shorter?"}, ["Why?", 2]]:  # a dict was read by key: a KeyError on turn 1
        with pytest.raises(ValueError, match="metadata 'followups' must be a list of strings, not "):
            sim([Conversation("q", {"followups": bad}, (Turn("assistant", "A"),))])
    prompts = textgym.load_prompts("followups")
    assert len(prompts) >= 20 and all(len(p.meta["followups"]) == 2 for p in prompts)


def test_echo_rewards_each_echo_and_says_the_next_word():
    env = gymnasium.make("textgym/Echo-v0").unwrapped
    env.reset(seed=0)
    words = env.episodes.prompts[env.episodes.prompt_index[0]].meta["words"]
    tok = env.tokenizer
    rewards = []
    for word in words:
        (_obs, reward, terminated, _truncated, info), _ = run(env, [*tok.encode(word), tok.eos_token_id])
        rewards.append(reward)
    assert rewards == [1.0, 1.0, 1.0] and terminated and info["finish_reason"] == "stop"


# -- adapters and registration --------------------------------------------------------------------------
class HotCold:
    """A text-level game in the shape of GEM's envs: reset() -> text, step(text) -> 5-tuple."""

    def __init__(self, target="c"):
        self.target = target

    def reset(self, target=None):  # takes the prompt's metadata key it knows
        self.target = target or self.target
        self.moves = 0
        return "guess a letter"

    def step(self, text):
        self.moves += 1
        won = text == self.target
        return ("win" if won else "cold"), (1.0 if won else -0.1), won, self.moves >= 3, {}


class Counter:
    """A TRL environment_factory-style class: reset(), public methods are tools, get_reward()."""

    def reset(self, **row):
        self.value, self.goal = 0, row["goal"]
        return f"Reach {row['goal']}."

    def increment(self, step: int) -> int:
        """Add step to the counter.

        Args:
            step: how much to add.
        """
        self.value += step
        return self.value

    def get_reward(self) -> float:
        return float(self.value == self.goal)


def test_a_tool_that_hangs_is_cut_at_tool_timeout_and_the_model_reads_why():
    """A tool that hung (a remote call, a deadlock) stalled the whole batched step, and training with it."""
    import threading
    import time

    from textgym.responders import Conversation, ToolEnvResponder, Turn

    released = threading.Event()

    class Slow(Counter):
        def wait(self) -> str:
            """Never returns in time."""
            released.wait(30)
            return "late"

    responder = ToolEnvResponder(Slow, tool_timeout=0.2)
    call = '<tool_call>{"name": "NAME", "arguments": ARGS}</tool_call>'
    replies = []
    for name, args in [("wait", "{}"), ("increment", '{"step": 1}')]:
        c = Conversation(
            "q", {"goal": 1}, (Turn("assistant", call.replace("NAME", name).replace("ARGS", args)),)
        )
        responder.start([c])
        start = time.perf_counter()
        replies.append(responder([c])[0].text)
        assert time.perf_counter() - start < 5
    released.set()
    assert replies == ["error: wait did not return within 0.2 s.", "1"]
    with pytest.raises(ConfigError, match="tool_timeout must be a number of seconds > 0, not 0"):
        ToolEnvResponder(Slow, tool_timeout=0)
    # a misspelled key went to the class, which failed at the first reset ("takes no arguments")
    with pytest.raises(PluginArgumentError, match=r"tool_env 'Slow' got unknown argument\(s\) 'tool_timout'. Did "
                                                  r"you mean 'tool_timeout'\?"):  # fmt: skip
        make_responder({"tool_env": "test_multiturn_envs:Counter", "name": "Slow", "tool_timout": 10})


@pytest.mark.parametrize("reward", ["1", True])
def test_a_text_envs_reward_is_checked_as_a_replys(reward):
    """float() took the string "1" and True from a text env's step(), which a Reply is refused."""

    class Lenient(HotCold):
        def reset(self):
            return "a"

        def step(self, text):
            return "ok", reward, False, False, {}

    env = char_env(textgym.responders.TextEnvResponder(Lenient))
    env.reset(seed=0)
    with pytest.raises(
        ResponderError, match=rf"responder 'Lenient' returned reward {reward!r} .*finite number"
    ):
        env.step(EOS)


def test_a_text_level_env_class_runs_end_to_end_as_a_responder():
    env = TextGenVectorEnv(
        num_envs=2, model=CharTokenizer("abcdefghijklmnopqrstuvwxyz .\n"), prompts=[{"prompt": "play", "target": "d"}],
        rewards=[], max_new_tokens=20, max_prompt_tokens=20, chat_template=False, autoreset_mode="Disabled",
        responder=textgym.responders.TextEnvResponder(HotCold),
    )  # fmt: skip
    _obs, info = env.reset(seed=0)
    assert info["prompt"][0] == "play\n\nguess a letter"  # reset()'s text opens the episode
    tok, eos = env.tokenizer, env.eos_token_id
    total, finals = np.zeros(2), {}
    for a0, a1 in zip([*tok.encode("a"), eos, *tok.encode("d"), eos, 0, 0], [*tok.encode("b"), eos] * 3):
        _, rewards, terminated, truncated, infos = env.step(np.array([a0, a1]))
        total += rewards
        for i in np.flatnonzero(terminated | truncated):
            finals[i] = {k: infos[k][i] for k in ("finish_reason", "turns", "turn_rewards")}
            finals[i]["truncated"] = bool(truncated[i])
    assert total.tolist() == pytest.approx([0.9, -0.3])  # won on the second move; lost after three
    assert [t["text"] for t in finals[0]["turns"]] == ["a", "cold", "d"] and finals[0]["turn_rewards"] == [
        -0.1,
        1.0,
    ]
    assert not finals[0]["truncated"] and finals[0]["finish_reason"] == "stop"  # the game ended: terminated
    # the game's own time limit truncates the episode (Gymnasium's truncated), as the env's max_turns would
    assert (
        finals[1]["truncated"] and finals[1]["finish_reason"] == "max_turns" and len(finals[1]["turns"]) == 5
    )


def test_an_environment_factory_class_runs_end_to_end_as_a_responder(tokenizer):
    env = TextGenEnv(
        model="smollm2-135m-instruct", prompts=[{"prompt": "Use the counter.", "goal": 3}], rewards=[],
        max_new_tokens=400, max_prompt_tokens=200, responder={"tool_env": "test_multiturn_envs:Counter"},
    )  # fmt: skip
    _obs, info = env.reset(seed=0)
    assert (
        "Reach 3." in info["prompt"]
        and "- increment(step: int) -> int: Add step to the counter." in info["prompt"]
    )
    P = env.max_prompt_tokens

    def turn(text):
        out, _ = run(env, [*tokenizer.encode(text, add_special_tokens=False), tokenizer.eos_token_id])
        obs, info = out[0], out[4]
        return out, tokenizer.decode(obs["input_ids"][P:][info.get("env_token_mask", np.zeros(1))[P:] == 1])

    call = '<tool_call>{"name": "increment", "arguments": {"step": 2}}</tool_call>'
    assert "<|im_start|>tool\n2<|im_end|>" in turn(call)[1]
    assert (
        "error: unknown tool 'decrement'; tools: increment."
        in turn('<tool_call>{"name": "decrement"}</tool_call>')[1]
    )
    assert "error: the tool call is not valid JSON" in turn("<tool_call>{name: increment}</tool_call>")[1]
    assert (
        "error: increment: missing a required argument: 'step'"
        in turn('<tool_call>{"name": "increment"}</tool_call>')[1]
    )
    (_, _, _, _, info), replies = turn(call.replace("2", "1"))
    assert "\n3<|im_end|>" in replies
    (_, reward, terminated, _, info), _ = turn("Done: 3.")
    assert terminated and reward == 1.0 and info["turn_rewards"][-1] == 1.0  # get_reward() on the final turn


def test_responder_decorator_and_specs_go_through_the_plugin_manager():
    textgym.responder("countdown")(lambda conversations, start=3: [str(start) for _ in conversations])
    try:
        made = textgym.make_responder("countdown start=5")
        assert made([textgym.Conversation("p")]) == ["5"]
        rows = {row["name"]: row for row in plugin_info.plugins_report()}
        assert rows["textgym.plugins.calculator"]["registers"]["responder"] == ["calculator"]
        assert any(r["registers"].get("responder") == ["countdown"] for r in rows.values())
    finally:
        for name, _ in list(plugin_manager.pm.list_name_plugin()):
            if name.endswith("::<lambda>"):
                plugin_manager.unregister_plugin(name)
    with pytest.raises(UnknownNameError):
        textgym.make_responder("countdown")


def test_textgym_plugins_lists_responders(capsys):
    from textgym.cli import main

    assert main(["plugins"]) == 0
    out = capsys.readouterr().out
    assert "textgym.plugins.calculator  (built-in)\n    responders: calculator\n" in out
    assert "prompt sources: guess_number\n    responders: guess_number\n" in out


def test_vector_env_with_same_step_autoreset_restarts_conversations():
    env = TextGenVectorEnv(
        num_envs=2, model=CHARS, prompts=["ab"], rewards=[], max_new_tokens=8, max_prompt_tokens=2,
        responder=say("c", reward=1.0, done_after=1), autoreset_mode=AutoresetMode.SAME_STEP,
    )  # fmt: skip
    env.reset(seed=0)
    obs, rewards, terminated, _, infos = env.step(np.array([EOS, 2]))
    assert rewards.tolist() == [1.0, 0.0] and terminated.tolist() == [True, False]
    assert infos["final_info"]["turn_rewards"][0] == [1.0] and obs["attention_mask"][0, 2:].sum() == 0


def test_adapter_specs_name_a_class_in_a_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a relative path resolves against the current directory
    (tmp_path / "games.py").write_text(
        "class Parrot:\n"
        "    def reset(self):\n        return None\n"
        "    def step(self, text):\n        return text + text, 0.0, len(text) > 1, False, {}\n"
    )
    env = char_env({"text_env": "games.py:Parrot"}, max_new_tokens=12)
    env.reset(seed=0)
    (obs, _, _, _, _info), _ = run(env, [*ids("a"), EOS])
    assert obs["input_ids"][2:6].tolist() == [*ids("a"), EOS, *ids("aa")]
    # a name next to the adapter's key names the adapter (it was read as a registered responder's: refused)
    assert char_env({"text_env": "games.py:Parrot", "name": "parrot"}).episodes.responder.name == "parrot"


def test_the_environment_guide_prints_what_it_says(tmp_path):
    import os
    import subprocess
    import sys
    from pathlib import Path

    page = (Path(__file__).parents[1] / "docs" / "environments.md").read_text()
    script = tmp_path / "snippets.py"
    script.write_text("\n\n".join(re.findall(r"```python\n(.*?)```", page, flags=re.S)))
    result = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=600, env=os.environ
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "stop 1.0 ['<calc>14 + 15</calc>', '= 29', '29']" in result.stdout
    assert "True 1.0 {'role': 'tool', 'text': '2', 'tokens': 11}" in result.stdout


class Echoer:
    """A perfect Echo-v0 policy through SB3's ``predict``: it repeats the env's last word, then says EOS."""

    def __init__(self, env):
        self.env = env

    def predict(self, obs, deterministic=True):
        actions = []
        for i, (row, mask) in enumerate(zip(obs["input_ids"], obs["attention_mask"])):
            k = np.flatnonzero(mask)[-1]
            said_by_env = k < self.env.max_prompt_tokens or self.env.env_token_mask[i, k]
            actions.append(row[k] if said_by_env else self.env.eos_token_id)
        return np.array(actions), None


def test_step_by_step_evaluations_return_every_turns_reward():
    """evaluate_policy (SB3-style agents) and the sample tables of SB3 runs take an episode's return, not the
    reward of its last step: Echo-v0 pays 1 per turn, 3 turns."""
    from textgym.evaluate import evaluate_policy
    from textgym.sb3 import sb3_episodes

    def make():
        return gymnasium.make_vec("textgym/Echo-v0", num_envs=4, vectorization_mode="vector_entry_point",
                                  autoreset_mode="Disabled")  # fmt: skip

    env = make()
    returns, _ = evaluate_policy(Echoer(env), env, n_eval_episodes=4, return_episode_rewards=True, seed=5)
    assert returns == [3.0] * 4
    env = make()
    rows = sb3_episodes(Echoer(env), env, seed=5)
    assert [row["reward"] for row in rows] == [3.0] * 4
    # with their turns, as an LM agent's: the table showed the last turn under "weighted total"
    from textgym.formatting import format_table

    assert all(len(r["turns"]) == 5 and r["turn_rewards"] == [1.0, 1.0, 1.0] for r in rows)
    header, _, line, *_ = format_table(rows).splitlines()
    assert "conversation" in header and header.endswith("return (total + turns)") and "[user: " in line


def test_a_turn_ended_on_a_time_limits_last_step_is_the_last_turn():
    """The agent ends its turn with EOS on the TimeLimit's last step: it gets no other turn, so the episode
    ends as after its max_turns-th (truncated, "max_turns"; the responder told, its reply not shown), not as
    a completion cut without an EOS ("length", which the missing-EOS penalty would charge)."""
    told = []

    def reply(conversations):
        told.extend(c.last_turn for c in conversations)
        return [Reply("hh", reward=1.0) for _ in conversations]

    reply.name = "hh"
    tok = CharTokenizer("abh")
    env = TextGenEnv(model=tok, prompts=["ab"], rewards=[], max_new_tokens=20, max_prompt_tokens=2,
                     responder=reply, max_episode_steps=3, chat_template=False)  # fmt: skip
    env.reset(seed=0)
    for token in (*tok.encode("aa", add_special_tokens=False), tok.eos_token_id):
        obs, reward, terminated, truncated, info = env.step(token)
    assert (terminated, truncated, info["finish_reason"], reward) == (True, True, "max_turns", 1.0)
    assert told == [True] and tok.decode(obs["input_ids"][obs["attention_mask"] == 1]).endswith("aa<eos>")


# -- seeds, openings, endings, limits -------------------------------------------------------------------
class Dice:
    """A game with a random secret drawn in reset(seed): GEM's envs take the seed there."""

    instances, closed = 0, 0

    def __init__(self):
        Dice.instances += 1

    def reset(self, seed=None):
        self.secret = "abcdefgh"[np.random.default_rng(seed).integers(8)]
        return self.secret

    def step(self, text):
        return "", float(text == self.secret), True, False, {}

    def close(self):
        Dice.closed += 1


def dice_env(n=None, **kwargs):
    """Copies of one prompt, so only the game differs between episodes."""
    args = dict(model=CharTokenizer("abcdefgh\n"), prompts=["ab"], rewards=[], chat_template=False,
                max_new_tokens=4, max_prompt_tokens=8, responder=textgym.responders.TextEnvResponder(Dice))  # fmt: skip
    if n is None:
        return TextGenEnv(**args, **kwargs)
    return TextGenVectorEnv(num_envs=n, autoreset_mode="Disabled", **args, **kwargs)


def test_a_text_envs_games_follow_the_envs_seed_and_a_group_plays_one_game():
    from gymnasium.utils.env_checker import check_env

    env = dice_env()
    games = [env.reset(seed=0)[1]["prompt"] for _ in range(4)]  # drew an unseeded game each time
    assert len(set(games)) == 1 and games[0].startswith("ab\n\n")
    assert len({env.reset()[1]["prompt"] for _ in range(20)}) > 1  # and another each episode
    check_env(env)  # Gymnasium's determinism checks: the same seed, the same episode
    vector = dice_env(n=8)
    prompts = vector.reset(seed=1, options={"group_size": 4})[1]["prompt"]
    assert len(set(prompts[:4])) == len(set(prompts[4:])) == 1  # GRPO's group: one game per prompt
    assert list(prompts) == list(vector.reset(seed=1, options={"group_size": 4})[1]["prompt"])


def test_each_episodes_text_env_is_closed_when_the_episode_is_over():
    Dice.instances = Dice.closed = 0
    env = dice_env(n=2)
    env.reset(seed=0)
    env.step(np.array([2, 2]))
    env.step(np.array([env.eos_token_id, 3]))  # env 0's turn ends, and its game ends the episode
    assert Dice.closed == 1
    env.reset(seed=1)  # env 1 was reset before its episode ended: its game is over too
    assert (Dice.instances, Dice.closed) == (4, 2)
    env.close()  # and the episodes still going
    assert Dice.closed == 4


def test_an_opening_in_a_vocabulary_without_newlines_is_joined_with_what_it_can_write():
    def opening(conversations):
        return ["bye" for _ in conversations]

    responder = named(lambda cs: ["c" for _ in cs], "greeter")
    responder.start = opening
    env = TextGenEnv(model=CharTokenizer("abcdefghiy "), prompts=["hi"], rewards=[], responder=responder,
                     chat_template=False, max_new_tokens=4, max_prompt_tokens=8)  # fmt: skip
    assert env.reset(seed=0)[1]["prompt"] == "hi bye"  # "\n\n" is not in the alphabet: a PromptError
    env = TextGenEnv(model=CharTokenizer("abcdefghiy"), prompts=["hi"], rewards=[], responder=responder,
                     chat_template=False, max_new_tokens=4, max_prompt_tokens=8)  # fmt: skip
    assert env.reset(seed=0)[1]["prompt"] == "hibye"


def test_a_turn_ended_by_a_stop_string_that_is_the_end_of_message_marker_is_not_closed_twice():
    """A base model whose EOS is not the template's end of turn (Qwen2.5 base, Gemma) ends its turns on a
    stop string: the environment's tokens must not write that marker again."""
    import copy

    tok = copy.deepcopy(textgym.load_tokenizer("smollm2-135m-instruct"))
    tok.eos_token = "<|endoftext|>"
    env = TextGenEnv(model=tok, prompts=["Hello"], rewards=[], responder=say("hi", done_after=2),
                     stop=["<|im_end|>"], max_new_tokens=32, max_prompt_tokens=48, pad_token="<repo_name>")  # fmt: skip
    env.reset(seed=0)
    (obs, *_), _ = run(env, tok.encode("Yo<|im_end|>", add_special_tokens=False))
    text = tok.decode(obs["input_ids"][obs["attention_mask"] == 1])
    assert text.endswith("assistant\nYo<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


def test_a_turn_that_uses_up_the_token_budget_is_the_last_and_the_tool_env_scores_it():
    """Same tokens, same reward: the Counter's get_reward() was skipped when the budget, not max_turns,
    ended the episode."""
    tok = textgym.load_tokenizer("tiny-random-llama")
    turn = [*tok.encode('<tool_call>{"name": "increment", "arguments": {"step": 2}}</tool_call>',
                        add_special_tokens=False), tok.eos_token_id]  # fmt: skip
    seen = []
    for limits in (dict(max_turns=1, max_new_tokens=64), dict(max_new_tokens=len(turn))):
        env = TextGenEnv(model=tok, prompts=[{"prompt": "Use the counter.", "goal": 2}], rewards=[],
                         responder=textgym.responders.ToolEnvResponder(Counter), max_prompt_tokens=160, **limits)  # fmt: skip
        env.reset(seed=0)
        (_, reward, _, truncated, info), _ = run(env, turn)
        seen.append((info["finish_reason"], truncated, reward))
    assert seen == [("max_turns", True, 1.0), ("max_turns", True, 1.0)]


def test_responders_may_return_numpy_rewards_and_flags():
    respond = named(lambda cs: [Reply("c", np.float32(0.5), np.bool_(True)) for _ in cs], "np")
    env = char_env(respond)
    env.reset(seed=0)
    (_, reward, terminated, _, info), _ = run(env, [EOS])
    assert terminated and reward == 0.5 and type(info["turn_rewards"][0]) is float


def test_a_text_env_file_in_a_config_resolves_against_the_configs_directory(tmp_path, monkeypatch):
    from textgym.config import load_config

    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "run.toml").write_text(
        '[env]\nresponder = { text_env = "games.py:Game", x = "games.py" }\n'
    )
    monkeypatch.chdir(tmp_path)
    responder = load_config(tmp_path / "cfg" / "run.toml")["env"]["responder"]
    assert responder == {"text_env": f"{tmp_path / 'cfg' / 'games.py'}:Game", "x": "games.py"}


def test_a_special_token_stop_string_is_no_text_at_the_last_turn(tokenizer):
    """At max_turns (or overflow) the turn's special-token stop string was counted as a token of text:
    length_penalty in tokens charged it."""
    seen = []

    def tokens(samples):
        seen.extend(samples)
        return [float(s.text_tokens()) for s in samples]

    stack = textgym.RewardStack([(textgym.FunctionReward("tokens", tokens), 1.0)])
    env = TextGenEnv(model="tiny-random-llama", prompts=["Hi"], rewards=stack, responder=say("ok"),
                     max_turns=1, stop=["<|im_start|>"], chat_template=False, max_new_tokens=16)  # fmt: skip
    env.reset(seed=0)
    paris = tokenizer.encode("Paris", add_special_tokens=False)
    (_, _, _, _, info), _ = run(env, [*paris, tokenizer.convert_tokens_to_ids("<|im_start|>")])
    assert info["finish_reason"] == "max_turns" and info["completion"] == "Paris"
    assert seen[0].stop_tokens == 1 and seen[0].text_tokens() == len(paris)


def test_what_a_responder_changes_in_its_conversation_meta_stays_in_the_episode():
    """Conversation.meta was the prompt source's own dict: a responder that popped the follow-ups it asked
    left the prompt's next episodes none to ask."""
    asked = []

    def quiz(conversations):
        replies = []
        for c in conversations:
            questions = c.meta["followups"]
            asked.append(questions.pop(0))
            replies.append(Reply(asked[-1], done=not questions))  # the last follow-up ends it
        return replies

    tok = CharTokenizer("abcdefgh")
    env = TextGenEnv(model=tok, prompts=[{"prompt": "ab", "followups": ["c", "d"]}], rewards=[],
                     responder=quiz, max_new_tokens=12, max_prompt_tokens=2)  # fmt: skip
    for seed in (0, 1):
        env.reset(seed=seed)
        for _ in range(2):  # two turns, one per follow-up
            out, _ = run(env, [2, tok.eos_token_id])
        assert out[2]
    assert asked == ["c", "d", "c", "d"]  # the second episode asked both too (an IndexError before)
    assert env.episodes.prompts[0].meta["followups"] == ["c", "d"]  # the prompt's own metadata is intact


def test_rewards_see_the_episodes_meta_as_its_responder_left_it():
    """A game that drew its secret in start() kept it in the episode's meta, but the reward plugins read the
    prompt source's: a reward could not score against it."""

    class Secret:
        name = "secret"

        def start(self, conversations):
            for c in conversations:
                c.meta["reference"] = "b"  # drawn per episode, over the source's "a"
            return [None] * len(conversations)

        def __call__(self, conversations):
            return [Reply("", done=True) for _ in conversations]

    env = char_env(Secret(), prompts=[{"prompt": "ab", "reference": "a"}], rewards=[{"name": "match"}])
    env.reset(seed=0)
    (_, reward, *_), _ = run(env, [*ids("b"), CHARS.eos_token_id])
    assert reward == 1.0
    assert env.episodes.prompts[0].meta["reference"] == "a"  # the source's stays


def test_closing_an_env_twice_closes_its_responder_and_rewards_once():
    """Gymnasium: closing a closed env has no effect. A second close() ran every close() again."""
    closed = []

    class Sandbox:
        name = "sandbox"

        def __call__(self, conversations):
            return ["a" for _ in conversations]

        def close(self):
            if "responder" in closed:
                raise RuntimeError("the sandbox is already shut down")
            closed.append("responder")

    recorder = Recorder()
    recorder.close = lambda: closed.append("reward")
    env = char_env(Sandbox(), rewards=textgym.RewardStack([(recorder, 1.0)]))
    env.reset(seed=0)
    env.close()
    env.close()
    assert sorted(closed) == ["responder", "reward"]


def test_an_opening_the_tokenizer_cannot_write_names_the_responder_not_the_prompt():
    class Greeter:
        name = "greeter"

        def start(self, conversations):
            return ["Hello!" for _ in conversations]  # outside the alphabet

        def __call__(self, conversations):
            return ["a" for _ in conversations]

    with pytest.raises(ResponderError, match=r"responder 'greeter': the opening its start\(\) gave prompt 0 "
                                             r"\('Hello!'\) cannot go into the episode: prompt 0 .*cannot be "
                                             r"tokenized"):  # fmt: skip
        char_env(Greeter()).reset(seed=0)
