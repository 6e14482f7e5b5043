"""LoRA and plain GRPO cases on the tiny Qwen2 model, shared by the one-process tests and the 2-rank worker."""

from __future__ import annotations

import copy
import functools

import torch
from tensordict import lazy_stack

from fabric_learner.testing import grpo_batch, tiny_causal_lm, tiny_tokenizer

REPLIES = (3, 8, 5, 2)  # one sample per reply; ranks take halves
LR = 0.05
STEPS = 2


def lora_config():
    from peft import LoraConfig

    # init_lora_weights=False: A and B both random, so the adapters change the model from the start
    return LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0,
                      init_lora_weights=False)


def peft_model(seed: int = 0, adapter_seed: int = 1, tokenizer=None):
    """The tiny model (weights from ``seed``) with LoRA adapters (drawn from ``adapter_seed``)."""
    from peft import get_peft_model

    model = tiny_causal_lm(seed, tokenizer=tokenizer)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(adapter_seed)
        return get_peft_model(model, lora_config())


def wrap(model, tokenizer, generate=False):
    from torchrl.modules.llm import TransformersWrapper

    kwargs = {"generate_kwargs": {"max_new_tokens": 5, "do_sample": False}} if generate else {}
    return TransformersWrapper(model, tokenizer=tokenizer, input_mode="history", generate=generate,
                               return_log_probs=True, pad_output=False, **kwargs)


def grpo_case(lora: bool, seed: int = 0, adapter_seed: int = 1):
    """``(loss, policy, batch)``: GRPOLoss over the tiny model, with LoRA adapters when ``lora``."""
    from torchrl.objectives.llm import GRPOLoss

    tokenizer = tiny_tokenizer()
    model = peft_model(seed, adapter_seed, tokenizer) if lora else tiny_causal_lm(seed, tokenizer=tokenizer)
    policy = wrap(model, tokenizer)
    loss = GRPOLoss(policy, masking_strategy="rlhf")
    return loss, policy, grpo_batch(policy, list(REPLIES), seed)


def half(batch, rank: int, world_size: int = 2):
    n = batch.batch_size[0] // world_size
    return lazy_stack(list(batch.tensordicts[rank * n:(rank + 1) * n]))


def sgd():
    return functools.partial(torch.optim.SGD, lr=LR)


def prompts(n: int = 3, seed: int = 3):
    """A TensorDict of ``n`` user prompts for a generating wrapper."""
    from tensordict import TensorDict
    from torchrl.data.llm import History
    from torchrl.modules.llm.policies import ChatHistory

    from fabric_learner.testing import chats

    history = ChatHistory(prompt=History.from_chats([c[:1] for c in chats([1] * n, seed)]), batch_size=(n,))
    return TensorDict(history=history, batch_size=(n,))


def generated_log_probs(generator, model):
    """Greedy generation by ``generator``; its response log-probs and ``model``'s on the same tokens.

    torchrl 0.14.1's TransformersWrapper(generate=True) reports 0 for the first response token's
    log-prob, so that position is left out of both.
    """
    out = generator(prompts())
    theirs, ours = [], []
    for full, response, lp in zip(out.get(("tokens", "full"), as_list=True), out.get(("tokens", "response"), as_list=True),
                                  out.get(("log_probs", "response"), as_list=True)):
        start = len(full) - len(response)
        with torch.no_grad():
            logits = model(full[None]).logits[0].log_softmax(-1)
        mine = logits[start - 1:len(full) - 1].gather(-1, full[start:, None])[:, 0]
        theirs.append(lp[1:])
        ours.append(mine[1:])
    return torch.cat(theirs), torch.cat(ours)


def logits(model, tokens=None):
    tokens = torch.arange(5, 45).reshape(2, 20) if tokens is None else tokens
    with torch.no_grad():
        return model(tokens).logits


def generator_copy(lora: bool, tokenizer):
    """The engine's own model: other weights than the learner's (seed 7), LoRA adapters when ``lora``."""
    model = peft_model(7, 8, tokenizer) if lora else tiny_causal_lm(7, tokenizer=tokenizer)
    return wrap(copy.deepcopy(model), tokenizer, generate=True)
