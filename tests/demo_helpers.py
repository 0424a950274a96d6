"""Replaying a recorded demonstration on a real env, checking every turn it recorded."""


def replay_demo(env, demo, obs, listed: bool = True) -> list:
    """Replay ``demo`` on ``env`` from ``obs`` (the reset it was recorded from). Each planner
    turn must see the observation and subgoal candidates it recorded; each executor turn its
    subgoal, observation and action candidates (and, where ``listed``, find its action among
    them: ScienceWorld's are capped at 40, and an expert's may be beyond); each subgoal must
    end exactly on its last recorded action, and no action may be left over. Returns every
    step's result."""
    results, steps = [], iter(demo.executor)
    for plan in demo.planner:
        assert plan.observation == obs.text and plan.candidates == obs.subgoals
        assert env.set_subgoal(plan.subgoal) == ""
        result = None
        while result is None or not result.subgoal_done:
            step = next(steps)
            assert step.subgoal == plan.subgoal and step.observation == obs.text
            assert step.candidates == obs.actions and (step.action in obs.actions or not listed)
            result = env.step(step.action)
            obs = result.observation
            results.append(result)
    assert next(steps, None) is None and demo.length == len(demo.executor) == len(results)
    return results
