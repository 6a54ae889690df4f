"""Writes expected.json. Every value here was derived independently of nanhunt: by reasoning
about the script and checking it with tools/locate_first.py (a TorchDispatchMode locator of the
first op that makes a non-finite value from finite inputs, and of fp32->fp16 gradient casts that
flush), tools/gradnorms.py (per-module unscaled gradient norms per step), tools/amax.py
(per-module forward amax) and float32 controls of the same script (--precision fp32 etc.).

Field semantics (see run.py):
  exit    expected exit code of `nanhunt diagnose` (0 healthy, 1 problem found, 3 script failure)
  phase   str or list of acceptable phases (first_failure.phase, else diagnosis.phase); null = not checked
  kind    str or list of acceptable diagnosis.kind; null = not checked
  module  str or list of acceptable module names (first_failure.module, else diagnosis.module);
          "" means "no module" (also matches null/""); null = not checked
  step    the step (0-based optimizer/scaler step) of the first failure, informational
  source_contains  optional: a substring that must appear in first_failure.source_line, or in
          the diagnosis message/evidence (for loop-misuse cases: the offending call)
  fix     acceptable recommendation types (secondary score, not part of PASS)
"""
from pathlib import Path
import json

E = {}


def add(script, exit, phase=None, kind=None, module=None, step=None, notes="", fix=None,
        source_contains=None):
    E[script] = dict(exit=exit, phase=phase, kind=kind, module=module, step=step, notes=notes,
                     fix=fix or [])
    if source_contains:
        E[script]["source_contains"] = source_contains


add("f01_t5_ffn_overflow.py", 1, "forward", "overflow", "blocks.1.ffn.wo", 0,
    "T5 outlier FFN units: aten.mm in blocks.1.ffn.wo gives +inf from finite input (amax 231); "
    "fp32 control amax 1.1e5, finite; GradScaler then skips every step", ["fp32_module", "clamp"])
add("f02_attn_scores_overflow.py", 1, "forward", "overflow", "layers.0.attn", 0,
    "shared-QK scores |q|^2 = 1.25e5 overflow in aten.bmm (matmul before /sqrt(d)); after the "
    "division they would be 1.6e4 (fits); made by functional code in layers.0.attn.forward",
    ["fp32_module", "clamp"])
add("f03_unet_conv_overflow.py", 1, "forward", "overflow", "up.1.conv2", 0,
    "aten.convolution in up.1.conv2 gives inf; fp32 amax 1.06e5", ["fp32_module", "clamp"])
add("f04_raw_pixels_cnn.py", 1, "data", "bad_input", None, 0,
    "uint16 counts up to 60000 fed unnormalised (finite in fp16); conv1 output overflows at step 0; "
    "--normalize trains. module not checked (conv1 is where it overflows)",
    ["normalize_input", "fix_data"])
add("f05_raw_pcm_conv1d.py", 1, "data", "bad_input", None, 2,
    "24-bit clip /32768 reaches 65536 > fp16 max: the autocast cast of the waveform for "
    "encoder.conv0 makes inf at step 2 (steps 0-1 fine; step 3 finite again). module not checked "
    "(encoder.conv0 input)", ["normalize_input", "fix_data"])
add("f06_nan_batch_gru.py", 1, "data", "bad_input", None, 2,
    "NaN sensor readings in the windows of steps 2 and 3; no op makes the NaN (it is in the data)",
    ["fix_data"])
add("f07_inf_target_log_price_mlp.py", 1, "data", "bad_input", None, 4,
    "log(0) = -inf in the target of step 4 (computed in the data prep); loss inf at step 4 only; "
    "steps 0-1 are normal GradScaler calibration skips", ["fix_data"])
add("f08_underflow_molar_targets_mlp.py", 1, "backward", "underflow", ["head", "model", ""], 0,
    "dL/dpred ~1.6e-8 in fp32 flushes to 0 in the fp16 cast (256/256 flushed, ToCopyBackward at "
    "head's output); all grads 0, loss flat; fp32 control learns (1.9e-12 -> 6e-13)",
    ["init_scale"])
add("f09_underflow_tiny_loss_convae.py", 1, "backward", "underflow",
    ["decoder.2", "decoder", "model", ""], 0,
    "lambda 1e-4 x mean BCE: dL/dlogits ~3e-9 flushes (16384/16384) at the fp16 cast of the "
    "decoder output; loss flat; fp32 control learns (6.60e-5 -> 5.56e-5). (Corrected from "
    "decoder.3, which does not exist: the decoder has children 0-2 and its last layer, "
    "whose output is cast, is decoder.2.)", ["init_scale"])
add("f10_explode_rnn_lm.py", 1, "backward", "exploding_gradient", "rnn", 4,
    "unscaled grad norm 0.62 -> 6.8 -> 16 (rnn 0.44 -> 14, proj stays ~7), then inf in rnn's "
    "backward (aten.mm) at step 4 while proj is finite; GradScaler skips 4-5 steps; loss ends 20.7 "
    "vs 5.36 with --clip 0.25", ["clip_grad_norm"])
add("f11_explode_gru_lm.py", 1, "backward", "exploding_gradient",
    ["rnn", "rnn.cell", "rnn.cell.ih", "rnn.cell.hh"], 4,
    "grad norm 0.35 -> 0.97 -> 5.5 -> 18 (rnn.cell.* leads, decoder <5), then NaN/inf in "
    "rnn.cell's backward at step 4 while decoder grads stay finite; every later step skips, loss "
    "finite (38-100); --clip 0.25 trains (loss 5.0)", ["clip_grad_norm"])
add("f12_lr_too_high_half_cnn.py", 1, ["backward", "optimizer"], "lr_too_high", "regressor", 4,
    "pure fp16 SGD lr=0.1 on unnormalised targets: loss x30 per step (2e3 -> 1.9e9); the first "
    "non-finite is regressor's weight gradient (aten.mm, backward) at step 4, weights grew ~5x per "
    "step before; phase backward or optimizer accepted", ["lower_lr"])
add("f13_lr_too_high_adam_transformer.py", 1, ["forward", "optimizer"], "lr_too_high",
    ["blocks.0.attn", "blocks.0", "blocks.0.attn.out_proj"], 9,
    "AdamW lr=1.0: loss 5.7 -> 127 over 9 steps, weights grow ~1/step; first forward inf at step 9 "
    "in blocks.0.attn (in_proj addmm). Backward skips at steps 1, 2, 4 are GradScaler events",
    ["lower_lr"])
add("f14_collapse_stft_magnitude.py", 1, "backward", "nan_op", ["spec", "STFTMagnitude"], 0,
    "sqrt(re^2+im^2) of exactly-zero padded frames: sqrt backward aten.div makes NaN every step "
    "(finite grad_output); scale halves every step", ["eps", "clamp"])
add("f15_collapse_l2norm_colbert.py", 1, "backward", "nan_op", "norm", 0,
    "clamp(min) after sqrt(0) of zeroed padding rows: sqrt backward 0/0 NaN in module norm "
    "(L2Norm) every step; scale halves every step", ["eps", "clamp"])
add("f16_skips_scheduler_megatron_scale.py", 1, "loss_scaling", "loss_scale", None, 0,
    "init_scale 2^32: steps 0-14 all skipped (scale -> 2^17) while LambdaLR warm-up (12 steps) "
    "advances; torch warns lr_scheduler.step() before optimizer.step()", ["init_scale"])
add("f17_skips_sum_reduction_vae.py", 1, "loss_scaling", "loss_scale", None, 0,
    "reduction=sum loss ~8e3: 11 of 16 steps skipped (scale 65536 -> 32); the unscaled grads fit "
    "fp16 (a scale of 32 works), so not an overflow of the model itself", ["init_scale"])
add("f18_misuse_extra_optimizer_step.py", 1, ["optimizer", "loss_scaling", "backward"],
    "loss_scale", None, 0,
    "leftover optimizer.step() after scaler.step(): step 0's scaled grads overflow (normal skip) "
    "and the extra call applies them -> NaN weights, loss nan from step 1",
    ["scaler_usage"], source_contains="optimizer.step()")
add("f19_misuse_clip_before_unscale.py", 1, ["loss_scaling", "optimizer", "backward"],
    "loss_scale", None, None,
    "clip_grad_norm_ on scaled grads, then unscale: updates ~1/65536 of intended; nothing "
    "non-finite; loss flat 2.10 vs 1.93 with --fixed", ["scaler_usage"],
    source_contains="clip_grad_norm_")
add("f20_misuse_unscale_twice.py", 1, ["loss_scaling", "optimizer"], "loss_scale", None, 0,
    "second scaler.unscale_ raises RuntimeError at step 0 (issue 12 item 5 lists unscale_ twice "
    "as loop misuse to diagnose; a bare exit 3 with torch's message is the baseline behaviour)",
    ["scaler_usage"], source_contains="unscale_")
add("f21_adam_eps_half_transformer.py", 1, "optimizer", "underflow", None, 0,
    "AdamW eps=1e-8 -> 0 in fp16: aten.addcdiv_ writes inf/nan into every parameter at step 0 "
    "(first in order: embed.weight); module not checked", ["eps"])
add("f22_adam_eps_half_cnn.py", 1, "optimizer", "underflow", None, 0,
    "Adam eps=1e-8 -> 0 in fp16: aten.addcdiv_ writes inf/nan at step 0 (first: body.0.weight); "
    "module not checked", ["eps"])
add("f23_bert_layernorm_eps_half.py", 1, "forward", "underflow", "embeddings.LayerNorm", 0,
    "eps 1e-12 -> 0 in fp16; zero (padded) rows: (x-u)/sqrt(0) = 0/0 in aten.div; fp32 control "
    "finite", ["eps"])
add("f24_rmsnorm_eps_half_conformer.py", 1, "forward", "underflow", "blocks.0.norm", 0,
    "eps 1e-12 -> 0 in fp16; exactly-zero padded frames: rsqrt(0) = inf, 0*inf = NaN; fp32 "
    "control finite", ["eps"])
add("f25_clip_manual_ce_log0.py", 1, "forward", "nan_op", ["loss_fn", "ContrastiveLoss"], 0,
    "fp16 softmax of logit_scale=100 logits rounds to 0; aten.log -> -inf, 0*-inf = NaN in the "
    "loss module", ["clamp", "fp32_module"])
add("f26_bce_manual_unet_seg.py", 1, "forward", "nan_op", "", 21,
    "sigmoid(>8.3) = 1.0 in fp16 -> log(1-p) = -inf at step 21 in top-level bce_loss (functional, "
    "no module owns it); the model output is finite", ["clamp", "fp32_module"])
add("f27_masked_fill_1e9_fp16.py", 1, "forward", "overflow", "layers.0.self_attn", 0,
    "masked_fill(-1e9) on fp16 scores raises 'value cannot be converted to type c10::Half without "
    "overflow' in attention() called from layers.0.self_attn (issue 12 item 9)", ["clamp"],
    source_contains="masked_fill")
for h, note in [
    ("h01_mlp_scaler_warmup_sched.py", "3 calibration skips (65536 -> 8192) then clean; scheduler "
     "stepped only when the optimizer stepped; loss 5.1 -> 0.40"),
    ("h02_gpt_masks_inf.py", "-inf causal mask + finfo.min padding mask, all absorbed"),
    ("h03_gru_lm_ignore_index.py", "ignore_index=-100 on padded targets"),
    ("h04_conv1d_clip_after_unscale.py", "unscale_ -> clip_grad_norm_ -> step -> update; loss 2.49 -> 0.0035"),
    ("h05_cnn_grad_accumulation.py", "4 micro-batches per step, one unscale_/step/update"),
    ("h06_bf16_autocast_transformer.py", "bf16 autocast, no scaler; loss 20.3 -> 17.4"),
]:
    add(h, 0, notes=note)

with open(str(Path(__file__).resolve().parent / "expected.json"), "w") as f:
    json.dump(E, f, indent=1)
print(len(E), "entries")
