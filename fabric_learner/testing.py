"""Ready-made pieces for examples and quick checks: small torchrl losses and batches they train on.

The package's docstrings build their examples from these instead of each spelling out a loss and
a batch, and a script can use them the same way to try a learner before it has an environment.
Every builder is deterministic in ``seed`` and leaves the global random state alone.
"""

from __future__ import annotations

from typing import Any

import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule
from torch import nn
from torchrl.modules import MLP, ValueOperator
from torchrl.objectives import DDPGLoss, DQNLoss

__all__ = ["chats", "ddpg_example", "dqn_batch", "dqn_example", "grpo_batch", "grpo_example", "tiny_causal_lm", "tiny_tokenizer"]


def _transitions(n: int, seed: int, observation_size: int, action) -> TensorDict:
    """``n`` transitions with random observations and rewards, no episode ending; ``action(generator)``."""
    generator = torch.Generator().manual_seed(seed)
    never = torch.zeros(n, 1, dtype=torch.bool)
    return TensorDict(
        observation=torch.randn(n, observation_size, generator=generator),
        action=action(generator),
        next=TensorDict(observation=torch.randn(n, observation_size, generator=generator),
                        reward=torch.randn(n, 1, generator=generator), done=never, terminated=never.clone(),
                        batch_size=[n]),
        batch_size=[n],
    )


def dqn_batch(n: int = 8, seed: int = 0, *, observation_size: int = 4, num_actions: int = 2) -> TensorDict:
    """``n`` random transitions in the layout torchrl's ``DQNLoss`` reads.

    Entries: ``observation``, ``action`` (an index below ``num_actions``) and, under ``next``,
    ``observation``, ``reward``, ``done`` and ``terminated`` (no episode ends). The same
    ``seed`` gives the same batch.

    Examples:
        >>> from fabric_learner.testing import dqn_batch
        >>> batch = dqn_batch(n=4)
        >>> batch.batch_size, batch["observation"].shape, batch["next", "reward"].shape
        (torch.Size([4]), torch.Size([4, 4]), torch.Size([4, 1]))
        >>> (batch == dqn_batch(n=4)).all()
        True
    """
    return _transitions(n, seed, observation_size, lambda g: torch.randint(num_actions, (n,), generator=g))


def dqn_example(n: int = 8, seed: int = 0, **loss_kwargs: Any) -> tuple[DQNLoss, nn.Linear, TensorDict]:
    """A DQN loss over a linear Q-network, that network, and a batch of ``n`` transitions for it.

    The loss is ``DQNLoss(nn.Linear(4, 2), action_space="categorical", delay_value=False)``
    (``loss_kwargs`` are passed on, e.g. ``reduction="none"``); the network is the policy a
    collector would run (give it as ``policy=``); the batch is :func:`dqn_batch`. The network's
    initial weights depend on ``seed`` only.

    Returns:
        ``(loss, net, batch)``.

    Examples:
        >>> import torch
        >>> from fabric_learner import LocalLearner
        >>> from fabric_learner.testing import dqn_example
        >>> loss, net, batch = dqn_example(n=8)
        >>> learner = LocalLearner(loss, lambda params: torch.optim.Adam(params, lr=1e-3), policy=net)
        >>> sorted(learner.update(batch).keys())
        ['grad_norm', 'loss']
        >>> torch.equal(dqn_example()[1].weight, dqn_example()[1].weight)  # same seed, same network
        True
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        net = nn.Linear(4, 2)
    loss = DQNLoss(net, **{"action_space": "categorical", "delay_value": False, **loss_kwargs})
    return loss, net, dqn_batch(n, seed)


def ddpg_example(n: int = 8, seed: int = 0) -> tuple[DDPGLoss, TensorDictModule, TensorDict]:
    """A DDPG loss with linear networks shaped for ``Pendulum-v1``, its actor, and ``n`` transitions.

    The actor maps a 3-d ``observation`` to a 1-d ``action``; the critic reads both (through a
    one-layer torchrl ``MLP``). No target networks (``delay_actor=False, delay_value=False``). The
    actor is the policy a collector on Pendulum would run (give it as ``policy=``).

    Returns:
        ``(loss, actor, batch)``.

    Examples:
        >>> from fabric_learner import LocalLearner
        >>> from fabric_learner.testing import ddpg_example
        >>> loss, actor, batch = ddpg_example()
        >>> out = LocalLearner(loss, policy=actor).update(batch)
        >>> sorted(key for key in out.keys() if key.startswith("loss"))
        ['loss_actor', 'loss_value']
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        actor = TensorDictModule(nn.Linear(3, 1), ["observation"], ["action"])
        critic = ValueOperator(MLP(in_features=4, out_features=1, num_cells=[]), in_keys=["observation", "action"])
    loss = DDPGLoss(actor, critic, delay_actor=False, delay_value=False)
    batch = _transitions(n, seed, 3, lambda g: torch.rand(n, 1, generator=g) * 4 - 2)  # Pendulum's torque: [-2, 2]
    return loss, actor, batch


# ---- language models (the ``llm`` extra: transformers, tokenizers) --------------------------------

_WORDS = ("the numbers are one two three four five six seven eight nine plus minus times equals answer "
          "think user assistant solve with each once").split()
_CHAT_TEMPLATE = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
                  "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def tiny_tokenizer():
    """A byte-level BPE tokenizer (vocabulary 300) trained here on a few words, with a ChatML template.

    Built with ``tokenizers`` and wrapped in transformers' ``PreTrainedTokenizerFast``: no download.
    Its pad token is ``<|endoftext|>`` and its end-of-turn token ``<|im_end|>``, as in Qwen2's.

    Examples:
        >>> from fabric_learner.testing import tiny_tokenizer
        >>> tokenizer = tiny_tokenizer()
        >>> len(tokenizer), tokenizer.decode(tokenizer("the answer is 42")["input_ids"])
        (300, 'the answer is 42')
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    bpe.train_from_iterator([" ".join(_WORDS)] * 4, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tokenizer.chat_template = _CHAT_TEMPLATE
    return tokenizer


def tiny_causal_lm(seed: int = 0, *, tokenizer=None, hidden_size: int = 64, num_layers: int = 2):
    """A ``Qwen2ForCausalLM`` built from a small ``Qwen2Config`` (random weights, no download).

    Hidden size 64, 2 decoder layers, 4 heads (2 key/value heads), untied head: ~113k parameters
    with :func:`tiny_tokenizer`'s vocabulary. The weights depend on ``seed`` only.

    Examples:
        >>> from fabric_learner.testing import tiny_causal_lm
        >>> model = tiny_causal_lm()
        >>> type(model).__name__, len(model.model.layers), sum(p.numel() for p in model.parameters())
        ('Qwen2ForCausalLM', 2, 112704)
    """
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tokenizer = tokenizer or tiny_tokenizer()
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                         num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=512, tie_word_embeddings=False, pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return Qwen2ForCausalLM(config)


def chats(reply_words: list[int], seed: int = 0) -> list[list[dict]]:
    """One user/assistant exchange per entry of ``reply_words``: the reply has that many words.

    Prompts have 2 to 6 words; words are drawn from a small vocabulary with ``seed``.

    Examples:
        >>> from fabric_learner.testing import chats
        >>> [len(chat[1]["content"].split()) for chat in chats([3, 9])]
        [3, 9]
    """
    generator = torch.Generator().manual_seed(seed)

    def words(n: int) -> str:
        return " ".join(_WORDS[int(i)] for i in torch.randint(len(_WORDS), (n,), generator=generator))

    return [[{"role": "user", "content": words(int(torch.randint(2, 7, (1,), generator=generator)))},
             {"role": "assistant", "content": words(n)}] for n in reply_words]


def grpo_batch(policy, reply_words: list[int], seed: int = 0) -> TensorDict:
    """A GRPO batch for ``policy`` (a ``TransformersWrapper`` with ``generate=False``): one sample per reply.

    The conversations are :func:`chats`; the sample log-probs and masks are ``policy``'s own (so
    the first importance weights are 1) and each sample gets a random advantage of shape
    ``[1, 1]``. Samples keep their own lengths (a lazy stack): each micro-batch is padded
    when the loss reads it, as torchrl's replay buffers hand them out.

    Examples:
        >>> from fabric_learner.testing import grpo_batch, grpo_example
        >>> loss, policy, _ = grpo_example()
        >>> batch = grpo_batch(policy, [2, 7, 4])
        >>> batch.batch_size, [int(mask.sum()) > 0 for mask in batch.get(("masks", "all_assistant_mask"), as_list=True)]
        (torch.Size([3]), [True, True, True])
    """
    from tensordict import lazy_stack
    from torchrl.data.llm import History
    from torchrl.modules.llm.policies import ChatHistory

    n = len(reply_words)
    history = ChatHistory(full=History.from_chats(chats(reply_words, seed)), batch_size=(n,))
    batch = lazy_stack(list(TensorDict(history=history, batch_size=(n,)).unbind(0)))
    with torch.no_grad():
        batch = policy(batch)
    advantages = torch.randn(n, 1, 1, generator=torch.Generator().manual_seed(seed))
    for sample, advantage in zip(batch.tensordicts, advantages):
        sample["advantage"] = advantage
    return batch


def grpo_example(reply_words: tuple[int, ...] = (3, 8, 5, 2), seed: int = 0, **loss_kwargs: Any):
    """torchrl's ``GRPOLoss`` on :func:`tiny_causal_lm` through ``TransformersWrapper``, and a batch for it.

    The policy reads conversations (``input_mode="history"``) and returns log-probs without
    generating; the loss masks the assistant's tokens (``masking_strategy="rlhf"``);
    ``loss_kwargs`` are passed on (e.g. ``aggregation="prompt_mean"``).

    Returns:
        ``(loss, policy, batch)``, the batch from :func:`grpo_batch`.

    Examples:
        >>> from fabric_learner import LocalLearner
        >>> from fabric_learner.testing import grpo_example
        >>> loss, policy, batch = grpo_example()
        >>> out = LocalLearner(loss, policy=policy).update(batch)
        >>> sorted(key for key in out.keys() if key.startswith("loss"))
        ['loss_entropy', 'loss_objective']
    """
    from torchrl.modules.llm import TransformersWrapper
    from torchrl.objectives.llm import GRPOLoss

    tokenizer = tiny_tokenizer()
    policy = TransformersWrapper(tiny_causal_lm(seed, tokenizer=tokenizer), tokenizer=tokenizer, input_mode="history",
                                 generate=False, return_log_probs=True, pad_output=False)
    loss = GRPOLoss(policy, **{"masking_strategy": "rlhf", **loss_kwargs})
    return loss, policy, grpo_batch(policy, list(reply_words), seed)
