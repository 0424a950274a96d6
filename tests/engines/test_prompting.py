"""Prompts with a history window: appended token blocks equal the chat template's own
multi-turn ids, each prompt extends the last within the window, and the window slides."""

import pytest

from hieragent.engines.prompting import Dialogue, Prompter


def template(tokenizer, messages):
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def reply_ids(tokenizer, text):
    return list(tokenizer.encode(text, add_special_tokens=False)) + [tokenizer.eos_token_id]


def test_history_prompts_are_the_chat_templates_multi_turn_ids(tokenizer):
    prompter = Prompter(tokenizer, history=2)
    dialogue = Dialogue()
    users, replies, last = [f"Subgoal: explore\nYou see {i} balls." for i in range(4)], ["go forward",
                                                                                       "turn left", "pick up", "drop"], None
    system = "You control an agent in a grid world. Reply with the next action."
    for turn, (user, reply) in enumerate(zip(users, replies)):
        prompt, block = prompter.prompt("executor", user, None, dialogue)
        shown = list(zip(users, replies))[max(turn - 2, 0):turn]
        messages = [{"role": "system", "content": system}]
        for u, r in shown:
            messages += [{"role": "user", "content": u}, {"role": "assistant", "content": r}]
        messages.append({"role": "user", "content": user})
        assert prompt == template(tokenizer, messages), turn
        if last is not None and turn <= 2:  # within the window: the last prompt and its reply, extended
            assert prompt[: len(last)] == last
        prompter.remember(dialogue, block, reply_ids(tokenizer, reply))
        last = prompt + reply_ids(tokenizer, reply)
    assert len(dialogue.turns) == 2


def test_without_history_the_prompt_is_the_single_turn_template(tokenizer):
    prompter = Prompter(tokenizer, history=0)
    dialogue = Dialogue()
    first, block = prompter.prompt("planner", "Mission: x", None, dialogue)
    prompter.remember(dialogue, block, reply_ids(tokenizer, "explore"))
    second, _ = prompter.prompt("planner", "Mission: x", None, dialogue)
    assert first == second and not dialogue.turns


def test_a_reply_cut_at_max_tokens_is_closed_with_the_end_of_turn(tokenizer):
    prompter = Prompter(tokenizer, history=1)
    dialogue = Dialogue()
    _, block = prompter.prompt("executor", "Subgoal: x", None, dialogue)
    cut = list(tokenizer.encode("go forward and then", add_special_tokens=False))
    prompter.remember(dialogue, block, cut)
    assert dialogue.turns[0][1][len(cut)] == tokenizer.eos_token_id


def test_negative_history_is_refused_by_name(tokenizer):
    with pytest.raises(ValueError, match="rollout.history"):
        Prompter(tokenizer, history=-1)
