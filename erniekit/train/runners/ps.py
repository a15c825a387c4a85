"""A parameter-server-mode worker (docs/ps.md): the blocks run here, the embedding and LM head
rows live on the servers; the worker (erniekit/train/ps_worker.py) talks to them."""

from __future__ import annotations

from erniekit.train.runners.base import StepRunner, StepSums


class PSRunner(StepRunner):
    name = "ps"
    partial = True

    def __init__(self, worker, token_balance: bool):
        self.worker = worker
        worker.token_balance = token_balance
        self.data_ranks = worker.data_ranks
        self.named_params: list = []

    def bind(self, trainer) -> None:
        self.named_params = [(n, p) for n, p in trainer.model.named_parameters() if not p.stop_gradient]

    def forward_backward(self, trainer, micro: list[dict], n_units: int, specs: list) -> StepSums:
        loss_sum, aux_sum = self.worker.run(micro, n_units,
                                            on_forward=lambda b: trainer.routing.after_forward(b["segment_ids"] > 0),
                                            normalizer=trainer.stage.normalizer)
        self.worker.reduce_grads(self.named_params)
        return StepSums(loss_sum=loss_sum, aux_sum=aux_sum)

    def clip(self, trainer, max_norm: float, lr: float) -> tuple[float, dict | None]:
        """The servers update their rows with the same norm and rate."""
        return self.worker.finish_step(self.named_params, max_norm, lr), None

    def after_update(self, step: int, final: bool = False) -> None:
        self.worker.after_step(step, final=final)

    def agree_stop(self, local: int) -> int:
        """Workers also carry a server's request (it answers their step's norm request with it);
        servers stop when the workers send STOP."""
        return self.worker.agree_stop(local)

    def before_stop(self, step: int) -> None:
        if self.worker.k_steps and step % self.worker.k_steps:
            self.worker.after_step(step, final=True)  # async: one block replica to save

    def finish(self) -> dict:
        w = self.worker
        out = {"ps_bytes_per_worker": {"sent": w.bytes_sent, "received": w.bytes_received,
                                       "pushed_row_gradients": w.push_bytes}}
        w.stop()
        import paddle.distributed as dist

        dist.barrier()  # every role leaves together (a server gone early tore the store down under others)
        return out

    # ---- checkpoints: worker 0 writes the servers' rows too ---------------------------------------
    def model_state(self, model):
        from erniekit.models.ernie4_5.checkpoint import hf_state_dict

        return self.worker.full_state(self.full_tensors(hf_state_dict(model)))

    def full_tensors(self, tensors):
        pipe = self.worker.pipe
        return tensors if pipe is None else pipe.gather_to_main(tensors)

    def optimizer_state(self, state):
        return self.worker.full_optimizer_state(self.full_tensors(state))

    def sync(self) -> None:
        self.worker.sync()
