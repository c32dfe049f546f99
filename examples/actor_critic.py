"""An actor-critic loop on ``service.Session`` (issue 35): episodes, not a dataset.

Each rank plays its own episodes of the classic cart-pole problem (written out below, so the example needs no
``gymnasium``; its ``np_random`` is a ``numpy.random.Generator`` as gymnasium's ``env.np_random`` is), one optimizer
step per episode through ``s.steps(n)``: the service's step boundary, checkpoints, preemption and exact resume. The
environment's generator and each rank's running reward are kept per rank, so a SIGTERM and a rerun give the
uninterrupted run's digest. The loop stops on every rank at the same step once the world's mean running reward passes
``--threshold`` (``s.mean``: a collective, never a ``break`` on one rank only).

    torchrun --nproc_per_node=2 examples/actor_critic.py --threshold 150
"""

from __future__ import annotations

import argparse
import math

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributions import Categorical

import service


class CartPole:
    """A pole on a cart, pushed left or right each tick; reward 1 a tick until it falls or leaves the track."""

    def __init__(self, seed: int, limit: int = 500) -> None:
        self.np_random = np.random.default_rng(seed)
        self.limit = limit
        self.state = np.zeros(4)
        self.ticks = 0

    def reset(self) -> np.ndarray:
        self.state, self.ticks = self.np_random.uniform(-0.05, 0.05, size=4), 0
        return self.state.astype(np.float32)

    def step(self, action: int) -> tuple[np.ndarray, float, bool]:
        x, x_dot, theta, theta_dot = self.state
        force = 10.0 if action == 1 else -10.0
        cos, sin = math.cos(theta), math.sin(theta)
        total_mass, pole_mass_length, half_length = 1.1, 0.05, 0.5
        temp = (force + pole_mass_length * theta_dot**2 * sin) / total_mass
        theta_acc = (9.8 * sin - cos * temp) / (half_length * (4.0 / 3.0 - 0.1 * cos**2 / total_mass))
        x_acc = temp - pole_mass_length * theta_acc * cos / total_mass
        tau = 0.02
        x, x_dot = x + tau * x_dot, x_dot + tau * x_acc
        theta, theta_dot = theta + tau * theta_dot, theta_dot + tau * theta_acc
        self.state, self.ticks = np.array([x, x_dot, theta, theta_dot]), self.ticks + 1
        done = abs(x) > 2.4 or abs(theta) > 12 * math.pi / 180 or self.ticks >= self.limit
        return self.state.astype(np.float32), 1.0, done


class Policy(nn.Module):
    """Actor and critic on one body: action probabilities and the state's value."""

    def __init__(self) -> None:
        super().__init__()
        self.body, self.actor, self.critic = nn.Linear(4, 128), nn.Linear(128, 2), nn.Linear(128, 1)

    def forward(self, states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = F.relu(self.body(states))
        return F.softmax(self.actor(hidden), dim=-1), self.critic(hidden).squeeze(-1)


def play(policy: nn.Module, env: CartPole) -> tuple[torch.Tensor, torch.Tensor, list[float]]:
    """One episode with the plain module, no graph kept: its states, actions and rewards."""
    states, actions, rewards = [], [], []
    state, done = env.reset(), False
    with torch.no_grad():
        while not done:
            probs, _ = policy(torch.from_numpy(state))
            action = int(Categorical(probs).sample())  # torch's generator: the service seeds it each step
            states.append(state)
            actions.append(action)
            state, reward, done = env.step(action)
            rewards.append(reward)
    return torch.from_numpy(np.stack(states)), torch.tensor(actions), rewards


def loss_of(model: nn.Module, states: torch.Tensor, actions: torch.Tensor, rewards: list[float],
            gamma: float) -> torch.Tensor:  # fmt: skip
    """The actor's policy-gradient loss and the critic's smooth L1 loss of one episode, in one forward."""
    returns, running = [], 0.0
    for reward in reversed(rewards):
        running = reward + gamma * running
        returns.insert(0, running)
    target = torch.tensor(returns)
    target = (target - target.mean()) / (target.std() + np.finfo(np.float32).eps.item()) if len(returns) > 1 else target
    probs, values = model(states)
    log_probs = Categorical(probs).log_prob(actions)
    advantage = target - values.detach()
    return -(log_probs * advantage).sum() + F.smooth_l1_loss(values, target, reduction="sum")


def main() -> None:
    with service.Session() as s:  # --config / --set for the service; the rest are this script's
        parser = argparse.ArgumentParser(description="actor-critic on a session")
        parser.add_argument("--gamma", type=float, default=0.99)
        parser.add_argument("--seed", type=int, default=543)
        parser.add_argument("--lr", type=float, default=3e-2)
        parser.add_argument("--episodes", type=int, default=1000)
        parser.add_argument("--threshold", type=float, default=475.0)
        args = parser.parse_args()
        env = CartPole(args.seed + s.rank)  # each rank its own episodes
        torch.manual_seed(args.seed)
        model = s.model(Policy())
        optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
        running = service.Carry(10.0)
        s.keep(model=model, optimizer=optimizer)
        s.keep_rank(env_rng=env.np_random, running=running)
        s.print(f"actor-critic: {s.world_size} rank(s), from episode {s.global_step}")
        for episode in s.steps(args.episodes):
            states, actions, rewards = play(s.unwrap(model), env)
            loss = loss_of(model, states, actions, rewards, args.gamma)
            optimizer.zero_grad()
            s.backward(loss)
            s.step(optimizer)
            running.value = 0.05 * sum(rewards) + 0.95 * running.value
            s.log(reward=sum(rewards), running_reward=running.value)
            if s.mean(running.value) > args.threshold:  # every rank decides alike: they stop at the same step
                s.print(f"solved at episode {episode}: the mean running reward is above {args.threshold}")
                break


if __name__ == "__main__":
    main()
