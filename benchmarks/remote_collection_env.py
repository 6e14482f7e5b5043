"""The slow step of benchmarks/remote_collection.py, in a module of its own: the collectors import it by name."""

import time

from torchrl.envs import Transform


class SleepPerStep(Transform):
    """Sleeps ``seconds`` at every step: an environment whose step costs real time."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds

    def _step(self, tensordict, next_tensordict):
        time.sleep(self.seconds)
        return next_tensordict
