"""Writes expected.json for the second red-team hold-out set. Every value was derived
independently of nanhunt (its rule code was not read while writing this set): by reasoning
about each script and checking it with the first set's reference tools,
benchmarks/redteam/tools/locate_first.py (TorchDispatchMode locator of the first op that makes a
non-finite value from finite inputs, and of fp32->fp16 gradient casts that flush),
tools/gradnorms.py (per-module unscaled gradient norms per step), tools/amax.py (per-module
forward amax), and float32 / fixed controls of the same script (--precision fp32, --lr, --clip,
--eps, --fixed, --normalize ...). The figures in each note were measured that way.

Field semantics are run.py's (see benchmarks/redteam/make_expected.py); in addition:
  class   the failure class of the brief (1..10, "healthy"); run.py prints a per-class score.
Module names are qualified names from named_modules() of the root model ("" = the root /
no module owns it; it also matches null).
"""
from pathlib import Path
import json

E = {}


def add(script, cls, exit, phase=None, kind=None, module=None, step=None, notes="", fix=None,
        source_contains=None):
    E[script] = dict(exit=exit, phase=phase, kind=kind, module=module, step=step, notes=notes,
                     fix=fix or [], **{"class": cls})
    if source_contains:
        E[script]["source_contains"] = source_contains


BW, FW, OPT, LS, DATA = "backward", "forward", "optimizer", "loss_scaling", "data"

# 1. backward gradient underflow without GradScaler
add("u01_underflow_rnn_strain_si_units.py", "1-underflow-backward", 1, BW, "underflow", ["head", ""], 0,
    "zero-init head, targets ~1e-6 m/m: dL/dpred max 1.36e-8 < fp16 min subnormal; locator --flush: "
    "512/512 flushed at the fp16 cast of head's output (ToCopyBackward of pred.float()), every step; "
    "fp16 loss flat 6.35e-12 -> 6.2e-12 (batch noise only, all grads 0); fp32 6.35e-12 -> 1.36e-12",
    ["init_scale", "grad_scaler"])
add("u02_underflow_kd_high_temperature_transformer.py", "1-underflow-backward", 1, BW, "underflow",
    ["lm_head", ""], 0,
    "KD at T=20 without T^2: dL/dlogits max 3.7e-8; locator --flush: 1023987/1024000 flushed (13 "
    "subnormal) at the fp16 cast of lm_head's output; fp16 kd 7.103e-3 -> 7.089e-3 (periodic over the "
    "4 batches, only AdamW weight decay moves), fp32 7.103e-3 -> 6.29e-3", ["init_scale", "grad_scaler"])

# 2. exploding gradients through time / depth
add("e01_explode_tanh_rnn_charlm_scaler.py", "2-exploding-gradient", 1, BW, "exploding_gradient", "rnn", 0,
    "W_hh std 2/sqrt(H) (radius ~2): fp32 unscaled grad norms step 0 rnn 7.46e3 / decoder 0.24 / embed "
    "207, step 1 rnn 9.6e7 / embed 9.9e8 / decoder 0.54; fp16: first non-finite = rnn backward "
    "(aten.add, in_amax 5.3e4) at step 0, 1 and 2, GradScaler skips nearly every step, loss NaN from "
    "step 27. The explosion is not an fp16 effect (fp32 grads 1e8-1e9, rnn ends saturated; fp32 loss "
    "3.73 at step 29); --clip 1 fp16 stays finite (4.25)", ["clip_grad_norm"])
add("e02_explode_deep_bn_mlp_no_scaler.py", "2-exploding-gradient", 1, BW, "exploding_gradient",
    ["60", ""], 0,
    "100-layer non-residual BN-ReLU MLP: fp32 weight-grad norms grow ~x1.2 per layer towards the "
    "input (layer '0' 3.9e7, '3' 9.2e7, ..., near the output 1e6 and below); fp16 autocast without "
    "scaler: first non-finite = aten.mm in the backward of Linear '60' at step 0 (then 57, 54, ... "
    "in backward order), inf grads applied, loss NaN from step 1; fp32: finite, 2.33 -> 2.32 (no "
    "learning, but no NaN); clip 1 in fp16 does not help (clip of inf = NaN)", ["clip_grad_norm", "grad_scaler"])

# 3. harmful GradScaler skip streaks (+ h01 as the calibration control)
add("s01_skips_sum_tokens_transformer.py", "3-skip-streak", 1, LS, "loss_scale", None, 0,
    "reduction=sum over 2048 tokens: steps 0-4 all skipped (65536 -> 2048) while LambdaLR's 5-step "
    "warm-up advances (lr 1.2e-3 ... 3e-3 on skipped steps), torch's 'lr_scheduler.step() before "
    "optimizer.step()' warning; the unscaled grads fit fp16 (scale 2048 works, no more skips). Harm "
    "here = the whole warm-up spent on skipped steps; the final loss/token is not worse in 24 steps "
    "(5.18 vs fp32 5.25, mean reduction 5.25 with 0 skips)", ["init_scale", "scheduler_order"])
add("s02_skips_init_scale_short_finetune_unet.py", "3-skip-streak", 1, LS, "loss_scale", None, 0,
    "init_scale 2^32 in a 10-step run: 10/10 steps skipped (scale 4.3e9 -> 4.2e6), weights never "
    "change; default init_scale 2^16: 0.224 -> 0.023 with no skips; fp32 control 0.224 -> 0.023",
    ["init_scale"])
add("s03_skips_growth_interval_1_moe.py", "3-skip-streak", 1, LS, "loss_scale", None, 4,
    "growth_interval=1: the scale doubles after every clean step and the next one overflows (first "
    "overflow at step 4, in head's backward aten.mm, then 6, 8, 11, ...): 13 of 30 steps skipped "
    "all through the run; loss 2.19 -> 1.26 vs 0.93 with the default growth_interval (0 skips) and "
    "0.93 in fp32", ["init_scale", "grad_scaler"])

# 4. loss-scale collapse from one backward op making NaN/inf every step
add("n01_collapse_gem_pool_dead_channels_cnn.py", "4-nan-op-collapse", 1, BW, "nan_op", "pool", 0,
    "GeM without clamp: dead channels give mean(x^p) = 0; locator: first non-finite = aten.log (d/dp "
    "of pow) and aten.pow inf in pool's backward, every step; 8-step run: every step skipped, scale "
    "65536 -> 256, loss 2.45 flat; not an fp16 effect (fp32 without eps: NaN from step 1); fp32 with "
    "--eps 1e-6: 2.46 -> 1.34 (in fp16 eps 1e-6 still underflows: x^3 = 1e-18 -> 0)",
    ["eps", "clamp", "fp32_module"])
add("n02_collapse_pairwise_distance_sqrt_gnn.py", "4-nan-op-collapse", 1, BW, "nan_op",
    ["layers.1", "layers.0"], 0,
    "sqrt of the self-pair squared distance (0) in DistanceLayer.forward: locator: SqrtBackward "
    "aten.div makes 96 NaN (= 8 graphs x 12 diagonal entries) at every step; a grad hook on d2 shows "
    "layers.1's sqrt backward runs first, then layers.0's (locator labels it <top:SqrtBackward0>: "
    "its node walk stops at already-labelled nodes). 30 steps all skipped, scale 32768 -> 6.1e-5; "
    "--eps 1e-4 fp16 trains (0.917 -> 0.466, scale 16384), fp32 with eps 0.917 -> 0.312",
    ["eps", "clamp"])
add("n03_collapse_acos_self_similarity_speaker.py", "4-nan-op-collapse", 1, BW, "nan_op", "angles", 0,
    "acos(clamp(cos, -1+1e-7, 1-1e-7)): the clamp bound is 1.0 in fp16; self-similarities == 1.0 "
    "reach acos' boundary; locator: aten.rsqrt inf (24-25 of 1024) in angles' backward every step; "
    "10 steps all skipped (scale 65536 -> 64), loss 0.115 -> 0.164; fp32: clamp works, 0.114 -> 0.021",
    ["eps", "clamp", "fp32_module"])

# 5. GradScaler misuse in the loop
add("m01_misuse_step_without_update_gru.py", "5-scaler-misuse", 1, [LS, OPT], "loss_scale", None, 1,
    "scaler.update() missing: the second scaler.step(opt) raises RuntimeError 'step() has already "
    "been called since the last update()' at step 1", ["scaler_usage"], source_contains="scaler.step")
add("m02_misuse_zero_grad_after_unscale_convvae.py", "5-scaler-misuse", 1, [LS, OPT, BW], "loss_scale",
    None, None,
    "opt.zero_grad() between scaler.unscale_ and scaler.step: grads are None at step, no update "
    "ever, nothing non-finite after calibration; loss flat 628 -> 627 over 20 steps vs --fixed "
    "628 -> 378", ["scaler_usage"], source_contains="zero_grad")
add("m03_misuse_optimizer_step_after_unscale_recsys.py", "5-scaler-misuse", 1, [OPT, LS, BW], "loss_scale",
    None, 0,
    "optimizer.step() instead of scaler.step(): step 0's scaled backward overflows (item_mlp.2 / "
    "user_mlp.2 aten.sum, a normal calibration overflow) and the inf/NaN grads are applied: NaN "
    "weights, loss nan from step 1", ["scaler_usage"], source_contains="optimizer.step()")
add("m04_misuse_clip_scaled_grads_transformer.py", "5-scaler-misuse", 1, [LS, OPT, BW], "loss_scale",
    None, None,
    "clip_grad_norm_(1.0) on grads scaled by 65536, no unscale_: updates ~1/65536 of intended; "
    "nothing non-finite; loss 1.40 -> 1.38 over 30 steps (chance 1.39) vs --fixed 1.40 -> 1.00",
    ["scaler_usage"], source_contains="clip_grad_norm_")

# 6. optimizer eps rounding to zero in .half() params
add("o01_adagrad_eps_half_embedding_recsys.py", "6-optimizer-eps", 1, OPT, "underflow", None, 0,
    "Adagrad eps 1e-10 -> 0 in fp16; rows not in the batch: 0/(sqrt(0)+0); locator: aten.addcdiv_ "
    "writes 88100 NaN + 7886 inf into item.weight (96000) at step 0; loss nan from step 1; fp32 "
    "0.691 -> 0.664", ["eps", "fp32_master"])
add("o02_rmsprop_eps_half_gru_forecaster.py", "6-optimizer-eps", 1, OPT, "underflow", None, 0,
    "RMSprop eps 1e-8 -> 0, (1-alpha) g^2 underflows: aten.addcdiv_ writes inf into the GRU weights "
    "at step 0 (1167/1536 of the first); loss nan from step 1; fp32 0.588 -> 0.019",
    ["eps", "fp32_master"])
add("o03_adam_eps_half_gnn.py", "6-optimizer-eps", 1, OPT, "underflow", None, 0,
    "Adam eps 1e-8 -> 0, 1e-3 g^2 underflows: aten.addcdiv_ writes inf into lin1.weight (2044/2048) "
    "at step 0; loss nan from step 1; fp32 1.614 -> 0.368", ["eps", "fp32_master"])

# 7. learning rate too high (clipping does not fix it)
add("l01_lr_too_high_adam_conv1d_keyword.py", "7-lr-too-high", 1, [BW, FW, OPT], "lr_too_high",
    ["fc", ""], 1,
    "Adam lr 0.3 + clip 1.0: loss 2.49 -> 1.78e4 after the first update, steps 1-13 skipped (scale "
    "65536 -> 8; first non-finite: fc's backward aten.mm at step 1, then convs.6/4/2), |w| 35 -> 158 "
    "(+~4/step), final 2.64 (chance 2.48); --lr 3e-3: 0.0003; --clip 0: 2.23; fp32 at lr 0.3: "
    "2.63 (the lr, not fp16)", ["lower_lr"])
add("l02_lr_too_high_adamw_dlrm.py", "7-lr-too-high", 1, [BW, FW, OPT], "lr_too_high", ["top.4", ""], 1,
    "AdamW lr 0.3 + clip 1.0: loss 0.69 -> 370 after the first update, 7 skips (65536 -> 256; first "
    "non-finite: top.4's backward aten.mm at step 1), |w| 173 -> 314, final 0.71; --lr 1e-3 0.676 "
    "(|w| 164); --clip 0 0.693; fp32 at lr 0.3 0.699", ["lower_lr"])

# 8. norm eps rounding to zero in fp16
add("g01_groupnorm_eps_hand_unet_blank_frames.py", "8-norm-eps", 1, FW, "underflow", "d1.1", 0,
    "hand GroupNorm eps 1e-12 -> 0 in fp16, bias-free conv on blank frames: var 0, aten.div 0/0 = "
    "8192 NaN (2 blank frames x 4 groups x 1024) in d1.1 at step 0; fp32 0.053 -> 0.0041",
    ["eps", "fp32_module"])
add("g02_layernorm_eps_half_empty_history_recsys.py", "8-norm-eps", 1, FW, "underflow", "user_norm", 0,
    "hand LayerNorm eps 1e-12 -> 0 in .half(); empty EmbeddingBag bags = zero rows: aten.div 736 NaN "
    "(23 cold-start users x 32) in user_norm at step 0; fp32 0.834 -> 0.725", ["eps", "fp32_module"])

# 9. unnormalised input / bad batch
add("d01_raw_int16_audio_conv1d.py", "9-bad-input", 1, DATA, "bad_input", None, 0,
    "int16-unit waveform (|x| <= 32767, fits fp16); front conv (251 taps) output inf: locator "
    "aten.convolution in front at step 0 (29/396800 inf), every step; fp32 amax(front) 7.6e4; fp16 "
    "loss nan every step, scale -> 64; fp32 finite 3115 -> 577; --normalize finite (2.39 after 10 "
    "steps). module not checked (front is where it overflows)", ["normalize_input", "fix_data"])
add("d02_uint16_microscopy_vit.py", "9-bad-input", 1, DATA, "bad_input", None, 0,
    "uint16 counts up to 65535 > 65504: autocast's cast of the patches for `patch` gives inf "
    "(locator: aten._to_copy in patch, step 0, in_amax 65535); loss nan every step; fp32 "
    "1.40 -> 1.22; --normalize 0.65. module not checked", ["normalize_input", "fix_data"])
add("d03_nan_missing_values_ft_transformer.py", "9-bad-input", 1, DATA, "bad_input", None, 3,
    "NaN 'income' values from row 384 = the batch of step 3 on; no op makes them; loss nan from step 3, "
    "every later step skipped; steps 0 and 2 are normal calibration overflows (encoder.layers.0."
    "self_attn backward); --impute 0.49", ["fix_data"])
add("d04_neg_inf_log_target_gnn.py", "9-bad-input", 1, DATA, "bad_input", None, 5,
    "target = log(solubility) with 3 zeros -> -inf (aten.log at preprocessing, before training, "
    "molecules 333/345 in the batch of step 5 and 700 in step 10); loss inf at steps 5 and 10 only "
    "(GradScaler skips them); fp32 without a scaler: NaN from step 5 on; --clamp 0.58",
    ["fix_data"])

# 10. out-of-range constants in fp16
add("c01_masked_fill_1e9_gru_attention_pool.py", "10-constant-overflow", 1, FW, "overflow", "pool", 0,
    "masked_fill(pad, -1e9) on fp16 scores (Linear under autocast) raises 'value cannot be converted "
    "to type c10::Half without overflow' in AttnPool.forward (module pool) at step 0; fp32 "
    "1.47 -> 1.04 (20 steps)", ["clamp"], source_contains="masked_fill")
add("c02_where_neg1e5_gat_isolated_nodes.py", "10-constant-overflow", 1, FW, "overflow", "gat1", 0,
    "torch.where(adj > 0, e, -1e5) on fp16: the scalar becomes -inf (locator: aten.scalar_tensor "
    "-1e5 -> -inf in gat1, then gat2); the isolated node's row is all -inf -> softmax NaN, loss NaN "
    "from step 0; fp32 1.35 -> 0.51", ["clamp"], source_contains="-1e5")

# healthy controls
for h, note in [
    ("h01_gru_regressor_calibration_skips.py", "4 calibration skips (65536 -> 4096) then none; "
     "loss 18.8 -> 1.71 (control of class 3)"),
    ("h02_cnn_warmup_skip_aware_scheduler.py", "warm-up + cosine stepped only when the optimizer "
     "stepped; no skips; loss 2.31 -> 1.72"),
    ("h03_transformer_masks_ignore_index.py", "-inf causal + finfo.min padding masks on fp16 scores, "
     "ignore_index=-100; loss 5.87 -> 5.57, no non-finite"),
    ("h04_rnn_clip_after_unscale.py", "unscale_ -> clip_grad_norm_(0.5) -> step -> update; loss "
     "4.20 -> 3.85"),
    ("h05_bf16_autocast_unet.py", "bf16 autocast, no scaler; loss 0.093 -> 0.012"),
    ("h06_fp32_gnn_no_autocast.py", "plain fp32; loss 1.62 -> 0.54"),
    ("h07_large_activations_3e4_mlp.py", "first Linear amax up to 2.75e4 (finite), LayerNorm after; "
     "loss 1.10 -> 0.41, no skips"),
    ("h08_grad_accumulation_two_tower.py", "4 micro-batches, one unscale_/clip/step/update; loss "
     "0.75 -> 0.51"),
    ("h09_dropout_batchnorm_conv1d.py", "BatchNorm1d + Dropout in train mode; loss 1.85 -> 0.38"),
    ("h10_loss_plateau_random_labels_mlp.py", "random labels: loss plateaus at 2.30 (log 10) from "
     "the start, all finite, no skips; a plateau is not a numerical failure"),
]:
    add(h, "healthy", 0, notes=note)

with open(str(Path(__file__).resolve().parent / "expected.json"), "w") as f:
    json.dump(E, f, indent=1)
print(len(E), "entries")
