"""The recovery LoRA's distillation in PyTorch (`edgemoe.train_lora --backend torch`).

MLX trains on one CPU core here, at about 10 s a step of 1,024 tokens on the bundled model;
PyTorch runs the same step, the routed experts' deltas included, in about 2 s with both
cores to itself (its OpenMP threads slow down many times beside another job). The student
is the same: the int4 pack dequantized to float32 (the values MLX computes with), every
expert resident, routed as it will be served: natively, or prerouted by the frozen heads
through the CUDA backend's own routing (edgemoe.cuda.prerouted, on the CPU). The deltas are
mlx-lm's LoRALinear (lora_a: in x rank, lora_b: rank x out) on the resident linear layers
and its LoRASwitchLinear (lora_a: experts x rank x in, lora_b: experts x out x rank) on the
routed experts, parameter for parameter, so the adapter is written in mlx-lm's format and
served by the MLX path, unmerged, the experts' deltas streamed with them. The teacher is
the pack itself (every expert resident, native routing, no adapter) or an unquantized
checkpoint (transformers' own class). The loss, batches, schedule and resumption are
train_lora's.

Runs the families whose experts are mlx-lm's SwitchGLU and whose transformers class the
CUDA backend builds (edgemoe.cuda.families); others are refused in one line.
"""

import json
import math
import os
from pathlib import Path
from typing import Dict, List

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn
from tqdm import tqdm
from transformers import AutoModelForCausalLM
from transformers.activations import ACT2FN

from . import families, prerouted
from .int4 import dequantize
from .model import _build, _load_resident
from ..format.adapters import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from ..format.pack import Pack, PackError, PackLayer
from ..format.source import model_path, open_source
from ..load_plan import heads_folder
from ..mlx_backend.families import find_experts

STATE = "train_state_torch"  # (train_lora.TORCH_STATE)
GATED = ("gate_proj", "up_proj", "down_proj")  # mlx-lm's SwitchGLU
TORCH_DTYPES = {"uint32": torch.int32, "float32": torch.float32, "float16": torch.float16,
                "bfloat16": torch.bfloat16}


class LoRALinear(nn.Module):
    """mlx-lm's LoRALinear: linear(x) + scale * (x @ lora_a) @ lora_b."""

    def __init__(self, linear: nn.Linear, rank: int, scale: float):
        super().__init__()
        self.linear, self.scale = linear, scale
        bound = 1 / math.sqrt(linear.in_features)
        self.lora_a = nn.Parameter(torch.empty(linear.in_features, rank).uniform_(-bound, bound))
        self.lora_b = nn.Parameter(torch.zeros(rank, linear.out_features))

    def forward(self, x):
        return self.linear(x) + self.scale * ((x @ self.lora_a) @ self.lora_b)


class ResidentExperts(nn.Module):
    """A MoE layer's routed experts, every one resident, dequantized from the pack, with
    mlx-lm's LoRASwitchLinear deltas (`rank` 0: none); called as transformers 5 calls
    its experts (hidden_states (T, D), top_k_index (T, k), top_k_weights (T, k))."""

    def __init__(self, weights: Dict[str, torch.Tensor], act, mlx_path: str):
        super().__init__()
        self.act, self.mlx_path, self.scale = act, mlx_path, 0.0
        for name in GATED:
            self.register_buffer(name, weights[name], persistent=False)  # (E, out, in)
        self.deltas = nn.ParameterDict()

    def add_deltas(self, rank: int, scale: float):
        self.scale = scale
        for name in GATED:
            experts, out, inp = getattr(self, name).shape
            bound = 1 / math.sqrt(inp)
            self.deltas[f"{name}_a"] = nn.Parameter(
                torch.empty(experts, rank, inp).uniform_(-bound, bound))
            self.deltas[f"{name}_b"] = nn.Parameter(torch.zeros(experts, out, rank))

    def forward(self, hidden_states, top_k_index, top_k_weights):
        k = top_k_index.shape[-1]
        flat = top_k_index.reshape(-1)
        entries, outputs = [], []
        for e in torch.unique(flat).tolist():
            entry = torch.where(flat == e)[0]  # (token * k + slot)
            x = hidden_states[entry // k]
            h = self.act(self._project("gate_proj", e, x)) * self._project("up_proj", e, x)
            entries.append(entry)
            outputs.append(self._project("down_proj", e, h))
        # back in entry order (a gather: index_add is slow on the CPU with autograd)
        y = torch.cat(outputs)[torch.argsort(torch.cat(entries))]
        y = y.reshape(*top_k_index.shape, -1) * top_k_weights[..., None]
        return y.sum(-2).to(hidden_states.dtype)

    def _project(self, name: str, e: int, x):
        y = x @ getattr(self, name)[e].T
        if self.deltas:
            a, b = self.deltas[f"{name}_a"][e], self.deltas[f"{name}_b"][e]
            y = y + self.scale * ((x @ a.T) @ b.T)
        return y


def expert_weights(source: Pack, layer: PackLayer) -> Dict[str, torch.Tensor]:
    """Every expert of `layer`, dequantized to float32: projection -> (E, out, in)."""
    if set(layer.quantization) != set(GATED):
        raise PackError(f"{source.path}: {layer.module} holds {sorted(layer.quantization)} "
                        f"experts; the PyTorch trainer takes SwitchGLU ({', '.join(GATED)})")
    fds = [os.open(f, os.O_RDONLY) for f in source.files]
    try:
        stacks = {t.name: [] for t in layer.tensors}
        for record in layer.records:
            raw = b"".join(os.pread(fds[i], length, offset)
                           for i, offset, length in record.segments)
            for t in layer.tensors:
                part = bytearray(raw[t.offset:t.offset + t.nbytes])
                stacks[t.name].append(torch.frombuffer(part, dtype=TORCH_DTYPES[t.dtype])
                                      .reshape(t.shape))
    finally:
        for fd in fds:
            os.close(fd)
    weights = {}
    for name in GATED:
        q = layer.quantization[name]
        parts = {kind: torch.stack(stacks[f"{name}.{kind}"])
                 for kind in ("weight", "scales", "biases") if f"{name}.{kind}" in stacks}
        if q is None:
            weights[name] = parts["weight"].float()
        elif q.get("mode", "affine") != "affine":
            raise PackError(f"{source.path}: {layer.module}.{name}: {q['mode']} weights; the "
                            f"PyTorch trainer dequantizes affine ones")
        else:
            weights[name] = dequantize(parts["weight"], parts["scales"], parts["biases"],
                                       q["group_size"], q["bits"])
    return weights


def build(path: Path, config: dict, experts: Dict[str, Dict[str, torch.Tensor]],
          rank: int = 0, scale: float = 0.0, keys: List[str] = ()) -> nn.Module:
    """transformers' model of the pack, float32 on the CPU, its experts (by mlx-lm module
    path) resident; with `rank`, LoRA deltas on `keys` (paths within a decoder layer,
    mlx-lm's names; "experts": the routed experts)."""
    families.check_runs(config, path / "config.json")
    model = _build(config, torch.float32)
    for module, weights in experts.items():
        block = families.moe_block(model.model.layers[int(module.split(".")[2])])
        act = getattr(block.experts, "act_fn", None) or ACT2FN[model.config.hidden_act]
        block.experts = ResidentExperts(weights, act, module)
    _load_resident(model, path, config, torch.float32, "cpu",
                   skip=tuple(f"{m}." for m in experts))
    for key in keys:
        if key == "experts":
            for module in model.modules():
                if isinstance(module, ResidentExperts):
                    module.add_deltas(rank, scale)
            continue
        for layer in model.model.layers:
            parent, _, name = key.rpartition(".")
            owner = layer.get_submodule(parent) if parent else layer
            linear = getattr(owner, name, None)
            if not isinstance(linear, nn.Linear):
                raise PackError(f"{path}: the PyTorch trainer adapts linear layers; {key} is "
                                f"{type(linear).__name__} in transformers' "
                                f"{config['model_type']} model")
            setattr(owner, name, LoRALinear(linear, rank, scale))
    model.requires_grad_(False)
    for module in model.modules():
        if isinstance(module, LoRALinear):
            module.lora_a.requires_grad_(True)
            module.lora_b.requires_grad_(True)
        if isinstance(module, ResidentExperts):
            module.deltas.requires_grad_(True)
    return model


def adapter_tensors(model: nn.Module) -> Dict[str, torch.Tensor]:
    """The deltas, named and shaped as mlx-lm saves them; the routed experts' in bfloat16,
    as they are read with every expert (half the bytes of float32; on the bundled model
    the same held-out KL to four digits)."""
    out = {}
    for name, module in model.named_modules():
        if isinstance(module, LoRALinear):
            out[f"{name}.lora_a"] = module.lora_a.detach().clone()
            out[f"{name}.lora_b"] = module.lora_b.detach().clone()
        elif isinstance(module, ResidentExperts) and module.deltas:
            for proj in GATED:
                for kind in ("a", "b"):
                    out[f"{module.mlx_path}.{proj}.lora_{kind}"] = \
                        module.deltas[f"{proj}_{kind}"].detach().to(torch.bfloat16)
    return out


def kd_loss(logits, teacher_logp):
    logp = F.log_softmax(logits.float(), -1)
    return (teacher_logp.exp() * (teacher_logp - logp)).sum(-1).mean()


def distil(args, out: Path, lora_config: dict, train_tokens: np.ndarray, batches, before):
    """Train the adapter of `lora_config` (apply_lora's, mlx-lm's format) and write it to
    `out` every --save-every steps, resumably; `batches(rng)` draws a step's windows and
    `before()` measures the student before training. Returns the run's state."""
    torch.manual_seed(args.seed)
    if "OMP_NUM_THREADS" not in os.environ:  # (a limit the user set stands)
        torch.set_num_threads(max(1, os.cpu_count() or 1))
    path = model_path(args.model)
    config = json.loads((path / "config.json").read_text())
    source = open_source(path, find_experts=find_experts)
    experts = {l.module: expert_weights(source, l)
               for l in tqdm(source.layers, desc="dequantize")}
    params = lora_config["lora_parameters"]
    keys = [k for k in params["keys"] if ".switch_mlp." not in k]
    if len(keys) < len(params["keys"]):
        keys.append("experts")
    student = build(path, config, experts, params["rank"], params["scale"], keys)
    if args.routing.advisory:
        raise ValueError(f"--backend torch trains --routing native or prerouted, not "
                         f"{args.routing}")
    if args.routing.routes:
        heads = prerouted.load_heads(heads_folder(path, args.routing, args.prerouter_path),
                                     "cpu")
        prerouted.install(student, None, heads, moe_layers=[l.index for l in source.layers])
    teacher = _teacher(args.teacher, path, config, experts)
    trainable = [p for p in student.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=args.lr, weight_decay=0.0)
    # train_lora's schedule: cosine from lr to lr / 10 over the run
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.1 + 0.9 * 0.5 * (
        1 + math.cos(math.pi * min(step, args.steps) / args.steps)))
    state = {"step": 0, "losses": [], "before": None}
    rng = np.random.default_rng(args.seed)
    if (out / STATE / "state.pt").exists():
        saved = torch.load(out / STATE / "state.pt", weights_only=False)
        student.load_state_dict(saved["student"], strict=False)
        optimizer.load_state_dict(saved["optimizer"])
        schedule.load_state_dict(saved["schedule"])
        state, rng.bit_generator.state = saved["state"], saved["rng"]
        print(f"resumed from {out / STATE}: step {state['step']}")
    if state["before"] is None:
        state["before"] = before()
    bar = tqdm(total=args.steps, initial=state["step"], desc="distil (torch)", unit="step")
    while state["step"] < args.steps:
        inputs = torch.from_numpy(np.asarray(batches(train_tokens, args, rng))).long()
        with torch.no_grad():
            teacher_logp = F.log_softmax(teacher(inputs, use_cache=False).logits.float(), -1)
        loss = kd_loss(student(inputs, use_cache=False).logits, teacher_logp)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()
        state["step"] += 1
        state["losses"].append(loss.item())
        bar.update(1)
        bar.set_postfix(kl=f"{np.mean(state['losses'][-10:]):.4f}")
        if state["step"] % args.save_every == 0 or state["step"] == args.steps:
            _save(out, student, optimizer, schedule, state, rng, lora_config)
    bar.close()
    return state


def _teacher(given, path: Path, config: dict, experts) -> nn.Module:
    """The pack itself (native routing, no adapter, the same resident experts), or an
    unquantized checkpoint in transformers' class."""
    if (Path(given) / "manifest.json").exists():
        if Path(given).resolve() != path.resolve():
            raise ValueError(f"--teacher {given}: --backend torch takes the student's own pack "
                             f"or an unquantized checkpoint as teacher")
        teacher = build(path, config, experts)
    else:
        teacher = AutoModelForCausalLM.from_pretrained(given, dtype=torch.float32)
    return teacher.eval().requires_grad_(False)


def _save(out: Path, student, optimizer, schedule, state, rng, lora_config):
    """The adapter as mlx-lm writes it, then the state a resumed run needs; each file is
    written aside and renamed, so a kill leaves the last whole save."""
    out.mkdir(parents=True, exist_ok=True)
    save_file(adapter_tensors(student), str(out / (ADAPTER_WEIGHTS + ".partial")))
    os.replace(out / (ADAPTER_WEIGHTS + ".partial"), out / ADAPTER_WEIGHTS)
    (out / ADAPTER_CONFIG).write_text(json.dumps(lora_config, indent=1))
    (out / STATE).mkdir(exist_ok=True)
    trained = {k: v for k, v in student.state_dict().items() if "lora_" in k or "deltas" in k}
    torch.save({"student": trained, "optimizer": optimizer.state_dict(),
                "schedule": schedule.state_dict(), "state": state,
                "rng": rng.bit_generator.state}, out / STATE / "state.pt.partial")
    os.replace(out / STATE / "state.pt.partial", out / STATE / "state.pt")
