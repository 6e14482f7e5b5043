"""GRPO on torchrl's Countdown numbers game: generate, score, group-relative advantages, learner update, weights out.

    python examples/grpo_countdown.py                       # 2 CPU ranks, FSDP2 (the learner starts rank 1)
    python examples/grpo_countdown.py --strategy ddp        # the same under DDP
    python examples/grpo_countdown.py --devices 1           # one process
    python examples/grpo_countdown.py --model PATH          # a local Hugging Face folder (model + tokenizer)
    torchrun --nproc-per-node=2 examples/grpo_countdown.py  # the same options under any launcher

Each rank draws its own Countdown problem (torchrl's ``CountdownEnv``: generated locally, no
download), samples ``--group`` completions of it with a ``TransformersWrapper(generate=True)`` over
a *separate generation copy* of the model (as an inference engine would), scores them, and turns
the rewards into group-relative advantages with torchrl's ``MCAdvantage`` (reward minus the group's
mean, over its standard deviation). The learner then takes one optimizer step on the group, in
micro-batches of at most ``--max-tokens`` padded tokens (``update_by_tokens``: as many as the
lengths need, agreed over the ranks), or with ``--micro-batch N`` in micro-batches of N samples as the
recipe cuts them, with GRPO's token mean exact over micro-batches and ranks; the learner's weights then refresh the
generation copy by parameter name, in buckets (``fabric_learner.llm``).

The training side is torchrl's ``sota-implementations/grpo/grpo-sync.py`` recipe (see
:func:`recipe_learner`): its ``GRPOLoss`` settings (KL to the inference policy 1e-2, entropy 1e-4),
its Adam (eps 1e-5), clipping at 1.0 and micro-batches of 4 samples, with a higher learning rate
(``--lr``) since a random model is trained for minutes here, not a 3B one for hours.

Reward: Countdown's own (1 for a right expression in ``<answer>`` tags, 0.1 for the tags alone),
which a random model never earns, plus a *format* reward in [0, 1]: the share of the reply's
characters that may appear in an answer expression (digits, ``+ - * / ( )`` and spaces). With the
tiny built-in model, generation is limited to tokens that decode to printable ASCII, so that
replies read back as the same text.
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import time

import torch
from tensordict import TensorDict, lazy_stack, set_list_to_stack

from fabric_learner import FabricLearner
from fabric_learner.cli import DefaultsHelpFormatter, add_launch_arguments, launch_kwargs
from fabric_learner.llm import load_weights, update_by_tokens, weight_buckets

ANSWER_ALPHABET = frozenset("0123456789+-*/() ")

# torchrl's grpo-sync recipe (config grpo_countdown.yaml, mode sync): what its training loop does.
RECIPE = {"kl_to_inference_coeff": 1e-2, "entropy_coeff": 1e-4, "lr": 1e-5, "eps": 1e-5, "weight_decay": 0.0,
          "clip_grad_norm": 1.0, "optim_batch_size": 32, "gradient_accumulation_steps": 8}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=DefaultsHelpFormatter)
    p.add_argument("--steps", type=int, default=100, help="optimizer updates (one group per rank each)")
    p.add_argument("--group", type=int, default=8, help="completions per problem (GRPO's group), per rank")
    p.add_argument("--max-tokens", type=int, default=2048, help="padded tokens per micro-batch (token budget)")
    p.add_argument("--micro-batch", type=int, default=None,
                   help="instead of --max-tokens: micro-batches of this many samples (the recipe's: 32 / 8 = 4)")
    p.add_argument("--max-new-tokens", type=int, default=16, help="tokens each completion may generate")
    p.add_argument("--lr", type=float, default=1e-3, help="the recipe's is 1e-5, for a pretrained 3B model")
    p.add_argument("--model", default=None, help="local Hugging Face folder (model and tokenizer, from_pretrained)")
    p.add_argument("--seed", type=int, default=0, help="seeds the model, problems and sampling")
    p.add_argument("--curve", default=None, help="write the reward per update to this JSON file (rank 0)")
    p.add_argument("--plot", default=None, help="write the reward curve to this PNG (rank 0; needs matplotlib)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_launch_arguments(p, accelerator="cpu", strategy="fsdp", devices=2)
    args = p.parse_args(argv)
    if args.group < 2 or (args.micro_batch and args.group % args.micro_batch):
        p.error(f"--group {args.group} must be at least 2 and a multiple of --micro-batch {args.micro_batch}")
    if args.max_tokens < 1:
        p.error(f"--max-tokens must be a positive number of tokens, got {args.max_tokens}")
    return args


def model_and_tokenizer(path: str | None, seed: int):
    """``(model, tokenizer, allowed_only)``: a local Hugging Face folder, or the tiny random Qwen2 of
    ``fabric_learner.testing`` (hidden 64, 2 layers) with its locally trained BPE tokenizer."""
    if path:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(path)
        return AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32), tokenizer, False
    from fabric_learner.testing import tiny_causal_lm, tiny_tokenizer

    tokenizer = tiny_tokenizer()
    return tiny_causal_lm(seed, tokenizer=tokenizer), tokenizer, True


def _printable_only(model, tokenizer) -> None:
    """Let ``model.generate`` sample only tokens that decode to printable ASCII (or end the turn)."""
    banned = [i for i in range(len(tokenizer))
              if i != tokenizer.eos_token_id and not all(32 <= ord(c) < 127 for c in tokenizer.decode([i]) or "\0")]
    model.generation_config.suppress_tokens = banned


def make_loss(policy, **overrides):
    """torchrl's ``GRPOLoss`` with the recipe's settings (``masking_strategy="rlhf"``: the assistant's tokens)."""
    from torchrl.objectives.llm import GRPOLoss

    settings = {"kl_to_inference_coeff": RECIPE["kl_to_inference_coeff"], "entropy_coeff": RECIPE["entropy_coeff"],
                "masking_strategy": "rlhf", **overrides}
    return GRPOLoss(policy, **settings)


def recipe_output_entries(loss) -> int:
    """How many entries the recipe's ``loss.mean(reduce=True)`` averages: the loss output's non-empty fields.

    ``GRPOLoss`` always returns ``loss_objective``, ``clip_fraction``, ``kl_approx`` and ``ESS``; the
    entropy bonus adds ``entropy`` and ``loss_entropy``, each KL term its loss and its value.
    """
    kl_to_ref = loss.kl_to_ref_coeff is not None and loss.kl_to_ref_coeff > 0
    return 4 + 2 * bool(loss.entropy_bonus) + 2 * kl_to_ref + 2 * (loss.kl_to_inference_coeff is not None)


def recipe_learner(loss, policy, *, lr: float, micro_batches: int, learner_cls=FabricLearner, **learner_kwargs):
    """A learner that steps as the recipe's loop: Adam, clipping, ``micro_batches`` per step.

    The recipe backpropagates ``loss.mean(reduce=True) / gradient_accumulation_steps``: the mean
    of the output's ``k`` entries (:func:`recipe_output_entries`; the logged ones carry no
    gradient), so its gradient is ``1/k`` of the loss terms' sum that the learner backpropagates.
    Adam does not see a constant gradient scale except through ``eps``, and clipping sees it in
    its threshold; so ``eps`` and the threshold are taken ``k`` times larger here, which gives the
    recipe's updates exactly. The remaining difference is the point of the learner: it weighs
    every token of the window equally, where the recipe weighs every micro-batch equally.
    """
    k = recipe_output_entries(loss)
    optimizer = functools.partial(torch.optim.Adam, lr=lr, eps=RECIPE["eps"] * k, weight_decay=RECIPE["weight_decay"])
    return learner_cls(loss, optimizer, policy=policy, clip_grad_norm=RECIPE["clip_grad_norm"] * k,
                       grad_accum_steps=micro_batches, **learner_kwargs)


def format_reward(replies: list[str]) -> torch.Tensor:
    """The share of each reply's characters that may appear in a Countdown answer (0 for an empty reply)."""
    return torch.tensor([sum(c in ANSWER_ALPHABET for c in r) / len(r) if r else 0.0 for r in replies])


def sample_group(env, generate, score, group: int) -> tuple[TensorDict, torch.Tensor, torch.Tensor]:
    """One Countdown problem, ``group`` completions: ``(training samples, total reward, Countdown's reward)``.

    The samples are a lazy stack (one per completion, each of its own length) holding the
    conversation, the generation copy's log-probs and masks, and the group-relative advantage
    (torchrl's ``MCAdvantage``) of shape ``[1, 1]``, as ``GRPOLoss`` reads them.
    """
    from torchrl.modules.llm.policies import ChatHistory
    from torchrl.objectives.llm import MCAdvantage

    with torch.no_grad():
        problem = env.reset()  # ``group`` copies of one problem
        rollout = env.step(generate(problem))
        conversations = rollout["history", "full"]
        samples = lazy_stack([TensorDict(history=ChatHistory(full=chat, batch_size=()), batch_size=())
                              for chat in conversations.unbind(0)])
        samples = score(samples)  # the log-probs of the replies as the learner will read them
    replies = list(rollout["text", "response"])
    countdown = rollout["next", "reward"].reshape(group)
    reward = countdown + format_reward(replies)
    done = torch.ones(group, 1, dtype=torch.bool)
    graded = MCAdvantage(grpo_size=group).inv(TensorDict(
        query=problem["query"], next=TensorDict(reward=reward.reshape(group, 1, 1), done=done, batch_size=[group]),
        batch_size=[group]))
    for sample, advantage in zip(samples.tensordicts, graded["advantage"].unbind(0)):
        sample["advantage"] = advantage.reshape(1, 1)
    return samples, reward, countdown


def refresh(generation_model, learner) -> None:
    """Load the learner's weights into the generation copy by parameter name, in buckets of 16 MiB.

    Under FSDP each bucket is gathered from the shards when it is filled (every rank iterates; every
    rank generates, so every rank receives them), so no rank holds two full copies beyond the
    generation copy itself. Raises when the copy has a parameter the learner did not send.
    """
    load_weights(generation_model, weight_buckets(learner, bucket_bytes=16 << 20))


def build(args, learner_kwargs: dict):
    """The learner (over the training model) and the generation copy; every rank builds the same."""
    from torchrl.modules.llm import TransformersWrapper

    model, tokenizer, printable_only = model_and_tokenizer(args.model, args.seed)
    generation_model = copy.deepcopy(model)  # before the learner shards or wraps the training model
    if printable_only:
        _printable_only(generation_model, tokenizer)
    policy = TransformersWrapper(model, tokenizer=tokenizer, input_mode="history", generate=False,
                                 return_log_probs=True, pad_output=False)
    micro_batches = args.group // args.micro_batch if args.micro_batch else 1  # a token budget sets its own
    learner = recipe_learner(make_loss(policy), policy, lr=args.lr, micro_batches=micro_batches, **learner_kwargs)
    generate = TransformersWrapper(generation_model, tokenizer=tokenizer, input_mode="history", generate=True,
                                   return_log_probs=True, pad_output=False,
                                   generate_kwargs={"max_new_tokens": args.max_new_tokens, "do_sample": True})
    score = TransformersWrapper(generation_model, tokenizer=tokenizer, input_mode="history", generate=False,
                                return_log_probs=True, pad_output=False)
    return learner, generation_model, generate, score, tokenizer


def main(argv=None):
    from torchrl.envs.llm import CountdownEnv

    from fabric_learner.onpolicy import global_mean

    args = parse_args(argv)
    set_list_to_stack(True).set()
    start = time.perf_counter()
    learner, generation_model, generate, score, tokenizer = build(args, launch_kwargs(args))
    rank, world = learner.global_rank, learner.world_size
    torch.manual_seed(args.seed + 1000 * rank)  # each rank samples its own completions
    env = CountdownEnv(tokenizer=tokenizer, num_envs=args.group, repeats=args.group, seed=args.seed + 1000 * rank,
                       input_mode="history")
    refresh(generation_model, learner)
    curve, replies, step_size = [], {}, args.micro_batch
    for step in range(args.steps):
        samples, reward, countdown = sample_group(env, generate, score, args.group)
        if step_size:
            for first in range(0, args.group, step_size):
                out = learner.update(samples[first:first + step_size])
        else:  # micro-batches of at most --max-tokens padded tokens, as many as the lengths need
            out = update_by_tokens(learner, samples, args.max_tokens)
        refresh(generation_model, learner)
        point = {"update": learner.num_updates, "reward": global_mean(reward).item(),
                 "countdown_reward": global_mean(countdown).item(), "seconds": time.perf_counter() - start,
                 "loss_objective": float(out["loss_objective"]), "grad_norm": float(out["grad_norm"])}
        curve.append(point)
        if step in (0, args.steps - 1):
            replies[learner.num_updates] = samples.tensordicts[0]["history", "full"][-1].content
        if rank == 0 and not args.no_progress:
            print(f"update {point['update']:4d}  reward {point['reward']:.3f}  (countdown {point['countdown_reward']:.2f})"
                  f"  {point['seconds']:.0f}s", flush=True)
    if rank == 0:
        how = "sharded (FSDP)" if learner.capabilities.sharded else type(learner.fabric.strategy).__name__
        print(f"done: {world} rank(s) {how}, {learner.num_updates} updates, {world * args.group * args.steps} "
              f"completions, {reward_report(curve)} in {time.perf_counter() - start:.0f}s", flush=True)
        if args.curve:
            with open(args.curve, "w") as f:
                json.dump({"command": _command(), "ranks": world, "group": args.group, "replies": replies,
                           "curve": curve}, f, indent=1)
        if args.plot:
            from _plot import learning_curve

            learning_curve([(p["update"], p["reward"]) for p in curve], args.plot,
                           title=f"GRPO on Countdown, tiny Qwen2, {world} CPU ranks ({how})", xlabel="optimizer update",
                           ylabel="mean reward (format + Countdown)")
    if hasattr(learner, "close"):
        learner.close()
    return curve


def reward_report(curve: list[dict], window: int = 10) -> str:
    """The mean reward of the first and of the last ``window`` updates, windows that never overlap
    (shorter on a run of fewer than ``2 * window`` updates; one mean for a run of one update)."""
    window = min(window, len(curve) // 2)
    if window == 0:
        return f"reward {_window_mean(curve):.3f} (one update)"
    first, last = _window_mean(curve[:window]), _window_mean(curve[-window:])
    windows = "the first and last updates" if window == 1 else f"means of the first and last {window} updates"
    return f"reward {first:.3f} -> {last:.3f} ({windows})"


def _window_mean(points) -> float:
    return sum(p["reward"] for p in points) / len(points)


def _command() -> str:
    from _plot import provenance

    return " ".join(provenance())


if __name__ == "__main__":
    main()
