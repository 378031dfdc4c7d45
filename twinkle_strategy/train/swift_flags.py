"""The flags of ``swift sft`` (ms-swift 4.6.0) that ``twinkle-sft`` does not take, each with the reason.

``SWIFT_SFT_FLAGS`` is every field of ms-swift 4.6.0's ``SftArguments`` (``tests/swift_plugin/test_swift.py`` checks the list
against the installed ms-swift). Each is either a ``twinkle-sft`` flag with swift's meaning (``cli.SWIFT_FLAGS``)
or a key of :data:`SWIFT_FLAGS_NOT_TAKEN`, whose one line says why and what to do instead; the CLI prints it
instead of a "did you mean" that would point at another flag (``--use_cpu`` is not ``--use_hf``).
``tests/unit/test_launch_error_lines.py`` checks that every listed flag is one or the other.
"""

from __future__ import annotations

SWIFT_VERSION = "4.6.0"  # the ms-swift whose SftArguments SWIFT_SFT_FLAGS lists (constraints-swift.txt pins it)

SWIFT_SFT_FLAGS = tuple("""
acc_strategy accelerator_config adalora_beta1 adalora_beta2 adalora_deltaT adalora_init_r
adalora_orth_reg_weight adalora_target_r adalora_tfinal adalora_tinit adam_beta1 adam_beta2 adam_epsilon
adapter_act adapter_length adapters add_non_thinking_prefix add_version agent_template aligner_lr attn_impl
auto_find_batch_size average_tokens_across_devices batch_eval_metrics bf16 bf16_full_eval
bnb_4bit_compute_dtype bnb_4bit_quant_storage bnb_4bit_quant_type bnb_4bit_use_double_quant boft_block_num
boft_block_size boft_dropout boft_n_butterfly_factor cached_dataset cached_val_dataset callbacks check_model
columns create_checkpoint_symlink custom_dataset_info custom_register_path data_seed dataloader_drop_last
dataloader_in_order dataloader_multiprocessing_context dataloader_num_workers dataloader_persistent_workers
dataloader_pin_memory dataloader_prefetch_factor dataset dataset_num_proc dataset_shuffle ddp_backend
ddp_broadcast_buffers ddp_bucket_cap_mb ddp_find_unused_parameters ddp_static_graph ddp_timeout debug
decision_drop_instructions decision_shuffle_fields decision_state_as_text decision_subsample_options deepspeed
deepspeed_autotp_size device_groups device_map disable_auto_column_mapping disable_ignore_empty_think
disable_tqdm do_eval do_predict do_train download_mode ds3_gather_for_generation early_stop_interval
enable_channel_loss enable_dft_loss enable_jit_checkpoint enable_npu_model_patch enable_thinking
eval_accumulation_steps eval_dataset eval_dataset_args eval_delay eval_do_concat_batches
eval_generation_config eval_limit eval_metric eval_on_start eval_steps eval_strategy eval_use_evalscope
eval_use_gather_object experts_impl external_plugins extra_eval_args fourier_n_frequency fourier_scaling fp16
fp16_full_eval freeze_aligner freeze_llm freeze_parameters freeze_parameters_ratio freeze_parameters_regex
freeze_vit fsdp fsdp_config full_determinism galore_cos_threshold galore_gamma_proj galore_optim_per_parameter
galore_proj_bits galore_proj_group_size galore_proj_quant galore_proj_type galore_quantization
galore_queue_size galore_rank galore_scale galore_target_modules galore_update_proj_gap galore_with_embedding
generation_config generation_max_length generation_num_beams gradient_accumulation_steps
gradient_checkpointing gradient_checkpointing_kwargs greater_is_better group_by_length hqq_axis
hub_always_push hub_model_id hub_private_repo hub_revision hub_strategy hub_token ignore_args_error
ignore_data_skip include_for_metrics include_num_input_tokens_seen init_strategy init_weights interleave_prob
is_binary_loss_scale label_names label_smoothing_factor lazy_tokenize learning_rate length_column_name
liger_kernel_config lisa_activated_layers lisa_step_interval llamapro_num_groups llamapro_num_new_blocks
load_args load_best_model_at_end load_data_args load_from_cache_file local_rank local_repo_path log_level
log_level_replica log_on_each_node logging_dir logging_first_step logging_nan_inf_filter logging_steps
logging_strategy logprobs lora_alpha lora_bias lora_dropout lora_dtype lora_ga_batch_size lora_ga_direction
lora_ga_iters lora_ga_max_length lora_ga_scale lora_ga_stable_gamma lora_rank lorap_lr_ratio loss_scale
loss_type lr_scheduler_kwargs lr_scheduler_type max_epochs max_grad_norm max_length max_memory max_model_len
max_new_tokens max_pixels max_shard_size max_steps metric_for_best_model model model_author model_kwargs
model_name model_revision model_type modules_to_save mrl_dims neftune_noise_alpha new_special_tokens norm_bbox
num_beams num_labels num_train_epochs optim optim_args optim_target_modules optimizer output_dir packing
packing_length packing_num_proc packing_strategy padding_free padding_side parallelism_config
per_device_eval_batch_size per_device_train_batch_size predict_with_generate prediction_loss_only
preserve_thinking problem_type project push_to_hub quant_bits quant_method ray_exp_name reft_args
reft_intervention_type reft_layer_key reft_layers reft_rank remove_unused_columns repetition_penalty report_to
response_prefix restore_callback_states_from_checkpoint resume_from_checkpoint resume_only_model rope_scaling
router_aux_loss_coef run_name safe_serialization save_on_each_node save_only_model save_steps save_strategy
save_total_limit seed sequence_parallel_size shuffle_buffer_size skip_memory_metrics sortish_sampler
split_dataset_ratio stop_words stopping_strategy stream streaming strict structured_outputs_regex
swanlab_email_language swanlab_exp_name swanlab_mode swanlab_notification_method swanlab_project
swanlab_receiver_email swanlab_secret swanlab_sender_email swanlab_smtp_port swanlab_smtp_server swanlab_token
swanlab_webhook_url swanlab_workspace system target_modules target_parameters target_regex task_type
temperature template template_backend tf32 top_k top_logprobs top_p torch_compile torch_compile_backend
torch_compile_mode torch_dtype torch_empty_cache_steps trackio_bucket_id trackio_space_id
trackio_static_space_id train_dataloader_shuffle train_sampling_strategy trainable_parameters
trainable_parameters_regex truncation_strategy tuner_backend tuner_type use_cache use_chat_template use_cpu
use_dora use_flash_ckpt use_galore use_hf use_liger_kernel use_logits_to_keep use_ray use_rslora
use_swift_lora val_dataset val_dataset_shuffle vera_d_initial vera_dropout vera_projection_prng_key vera_rank
vit_gradient_checkpointing vit_lr warmup_ratio warmup_steps weight_decay zero_hpz_partition_size
""".split())


def _flags(text: str) -> tuple[str, ...]:
    return tuple(text.split())


# reason -> the flags it covers (one line each when printed; grouped here so that one reason is written once).
_REASONS: dict[str, tuple[str, ...]] = {
    # evaluation and generation
    "twinkle-sft trains only and does not evaluate; drop it (evaluate a saved checkpoint with swift eval or "
    "swift infer)": _flags("""
        eval_strategy eval_steps eval_delay eval_on_start eval_accumulation_steps eval_do_concat_batches
        eval_use_gather_object per_device_eval_batch_size prediction_loss_only include_for_metrics
        batch_eval_metrics bf16_full_eval fp16_full_eval val_dataset cached_val_dataset val_dataset_shuffle
        split_dataset_ratio load_best_model_at_end metric_for_best_model greater_is_better eval_metric
        eval_use_evalscope eval_dataset eval_dataset_args eval_limit eval_generation_config extra_eval_args
        early_stop_interval predict_with_generate generation_max_length generation_num_beams generation_config
        do_eval do_predict acc_strategy sortish_sampler ds3_gather_for_generation"""),
    "twinkle-sft always trains; drop it": _flags("do_train"),
    "a generation setting of swift infer/deploy; twinkle-sft only trains, drop it": _flags("""
        max_new_tokens temperature top_k top_p repetition_penalty num_beams stream stop_words logprobs
        top_logprobs structured_outputs_regex template_backend"""),
    # logging
    "twinkle-sft logs every --logging_steps steps to <run dir>/logging.jsonl and images/, with no tracker "
    "integration; drop it": _flags("""
        report_to run_name project trackio_space_id trackio_bucket_id trackio_static_space_id logging_dir
        logging_strategy logging_first_step log_on_each_node logging_nan_inf_filter include_num_input_tokens_seen
        log_level log_level_replica disable_tqdm skip_memory_metrics swanlab_token swanlab_project
        swanlab_workspace swanlab_exp_name swanlab_notification_method swanlab_webhook_url swanlab_secret
        swanlab_sender_email swanlab_receiver_email swanlab_smtp_server swanlab_smtp_port swanlab_email_language
        swanlab_mode"""),
    # hubs
    "twinkle-sft does not upload; push <run dir>/checkpoint-N with `hf upload` or `modelscope upload` after "
    "training, and drop it": _flags("push_to_hub hub_private_repo hub_model_id hub_strategy hub_always_push "
                                   "hub_revision"),
    "a hub token comes from the environment (HF_TOKEN, or MODELSCOPE_API_TOKEN); drop it": _flags("hub_token"),
    "pin a revision by passing its local snapshot directory as --model; drop it": _flags("model_revision"),
    # tuners
    "twinkle-sft trains LoRA (PEFT) or every parameter (--tuner_type lora | full); drop it": _flags("""
        tuner_backend use_swift_lora use_galore galore_target_modules galore_rank galore_update_proj_gap
        galore_scale galore_proj_type galore_optim_per_parameter galore_with_embedding galore_quantization
        galore_proj_quant galore_proj_bits galore_proj_group_size galore_cos_threshold galore_gamma_proj
        galore_queue_size lisa_activated_layers lisa_step_interval boft_block_size boft_block_num
        boft_n_butterfly_factor boft_dropout vera_rank vera_projection_prng_key vera_dropout vera_d_initial
        adapter_act adapter_length adalora_target_r adalora_init_r adalora_tinit adalora_tfinal adalora_deltaT
        adalora_beta1 adalora_beta2 adalora_orth_reg_weight llamapro_num_new_blocks llamapro_num_groups
        reft_layer_key reft_layers reft_rank reft_intervention_type reft_args fourier_n_frequency fourier_scaling
        lora_ga_batch_size lora_ga_iters lora_ga_max_length lora_ga_direction lora_ga_scale lora_ga_stable_gamma"""),
    "twinkle-sft's LoRA is PEFT's default (initialization, scaling alpha/r, one learning rate); drop it":
        _flags("init_weights use_rslora lorap_lr_ratio"),
    "LoRA weights are kept as PEFT makes them, and computed as --mixed_precision says; drop it": _flags("lora_dtype"),
    "swift's --lora_bias trains the model's biases (PEFT bias='all'), which twinkle-sft does not; drop it "
    "(tuner.lora_bias=true is PEFT's lora_bias, a bias on LoRA's B)": _flags("lora_bias"),
    "name LoRA's targets with --target_modules (module names or all-linear) and --target_parameters; drop it":
        _flags("target_regex"),
    "the saved adapter holds the LoRA weights only (modules_to_save is not supported); drop it, or use "
    "--tuner_type full": _flags("modules_to_save"),
    "to continue from an adapter use --resume_from_checkpoint <checkpoint-N of a twinkle-sft run>; drop it":
        _flags("adapters resume_only_model"),
    "twinkle-sft trains every parameter with --tuner_type full, else the LoRA targets only (--target_modules, "
    "--target_parameters); drop it": _flags("""
        freeze_parameters freeze_parameters_regex freeze_parameters_ratio trainable_parameters
        trainable_parameters_regex freeze_llm freeze_aligner"""),
    "twinkle-sft trains vision-language checkpoints on text only, so the vision tower stays as it is; drop it "
    "(with LoRA, --target_modules names the language model's layers)": _flags("""
        freeze_vit vit_gradient_checkpointing vit_lr aligner_lr max_pixels norm_bbox"""),
    # quantization
    "twinkle-sft does not quantize on load (QLoRA); a quantized checkpoint (FP8 blocks, MXFP4) is read as its "
    "config.json says; drop it": _flags("""
        quant_method quant_bits hqq_axis bnb_4bit_compute_dtype bnb_4bit_quant_type bnb_4bit_use_double_quant
        bnb_4bit_quant_storage"""),
    # launch and parallelism
    "twinkle-sft shards with FSDP2 and expert parallelism itself; drop it (twinkle-sft --help lists the strategy "
    "flags, e.g. --expert_parallel_size)": _flags("""
        deepspeed fsdp fsdp_config zero_hpz_partition_size deepspeed_autotp_size accelerator_config
        parallelism_config device_map max_memory ddp_find_unused_parameters ddp_bucket_cap_mb
        ddp_broadcast_buffers ddp_static_graph"""),
    "twinkle-sft writes each checkpoint once, every rank its own shard into one shared output_dir; drop it":
        _flags("save_on_each_node"),
    "use --device_type cpu (strategy.device_type)": _flags("use_cpu"),
    "torchrun sets it; twinkle-sft re-launches itself under torchrun with NPROC_PER_NODE (as swift); drop it":
        _flags("local_rank"),
    "twinkle-sft launches with torchrun (NPROC_PER_NODE, NNODES, NODE_RANK, MASTER_ADDR); drop it":
        _flags("use_ray ray_exp_name device_groups"),
    "twinkle-sft does not apply swift's NPU model patches (--device_type npu runs the model as transformers defines it); drop it":
        _flags("enable_npu_model_patch"),
    # data
    "twinkle-sft reads and tokenizes every row of its JSONL files before training, in the training process; "
    "drop it": _flags("""
        dataset_num_proc load_from_cache_file lazy_tokenize packing_num_proc download_mode cached_dataset
        dataloader_num_workers dataloader_pin_memory dataloader_persistent_workers dataloader_prefetch_factor
        dataloader_multiprocessing_context dataloader_drop_last dataloader_in_order remove_unused_columns
        label_names length_column_name group_by_length train_sampling_strategy ignore_data_skip"""),
    "twinkle-sft reads whole JSONL files (no streaming or interleaving); mix files with --dataset a.jsonl "
    "b.jsonl#N, and drop it": _flags("streaming interleave_prob stopping_strategy shuffle_buffer_size"),
    "twinkle-sft shuffles the rows every epoch, seeded with --seed; drop it":
        _flags("dataset_shuffle train_dataloader_shuffle data_seed"),
    "rows need 'messages', or 'query' and 'response' (rename other columns before training); drop it":
        _flags("columns disable_auto_column_mapping"),
    "twinkle-sft takes JSONL files (--dataset), not swift's registered datasets; drop it": _flags("""
        custom_dataset_info custom_register_path model_name model_author decision_drop_instructions
        decision_subsample_options decision_state_as_text decision_shuffle_fields"""),
    "twinkle-sft packs best-fit into rows of up to --max_length tokens (swift's binpack); set --max_length, and "
    "drop it": _flags("packing_length packing_strategy"),
    # template
    "twinkle-sft formats rows with the tokenizer's own chat template; drop it": _flags("""
        template agent_template use_chat_template enable_thinking preserve_thinking add_non_thinking_prefix
        disable_ignore_empty_think response_prefix"""),
    "put the system prompt in each row's 'messages' as a 'system' turn (or a row's 'system' key); drop it":
        _flags("system"),
    "twinkle-sft trains on every assistant turn with weight 1 (swift's default loss scale); drop it":
        _flags("loss_scale is_binary_loss_scale"),
    "twinkle-sft pads on the right, as swift does for training; drop it": _flags("padding_side"),
    "add tokens to the tokenizer and resize the embeddings in the checkpoint before training; drop it":
        _flags("new_special_tokens"),
    # model
    "twinkle-sft reads the model type from config.json; drop it": _flags("model_type"),
    "twinkle-sft trains causal language models (and vision-language ones on text); drop it":
        _flags("task_type num_labels problem_type"),
    "twinkle-sft uses the model's default attention implementation; drop it": _flags("attn_impl"),
    "twinkle-sft runs the experts through its own expert-parallel dispatch; drop it": _flags("experts_impl"),
    "set it in the checkpoint's config.json; drop it": _flags("rope_scaling max_model_len model_kwargs"),
    "--model names a local directory or a hub id; drop it": _flags("local_repo_path"),
    "twinkle-sft loads every weight from the checkpoint and initializes only LoRA's new ones (as PEFT does); drop it":
        _flags("init_strategy"),
    "twinkle-sft checks the model directory before launch itself; drop it": _flags("check_model"),
    "twinkle-sft trains without the KV cache; drop it": _flags("use_cache"),
    # training
    "use --mixed_precision bf16 (and --torch_dtype for the weights)": _flags("bf16"),
    "use --mixed_precision fp16 (and --torch_dtype for the weights)": _flags("fp16"),
    "twinkle-sft trains with AdamW (--optim adamw_torch_fused | adamw_torch, --learning_rate, --weight_decay, "
    "--adam_beta1, --adam_beta2, --adam_epsilon); drop it": _flags("optim_args optim_target_modules optimizer "
                                                                   "lr_scheduler_kwargs"),
    "twinkle-sft's loss is the mean cross-entropy over every response token of the global batch; drop it":
        _flags("loss_type enable_dft_loss enable_channel_loss mrl_dims label_smoothing_factor "
               "average_tokens_across_devices"),
    "twinkle-sft saves every --save_steps steps and at the end (--save_steps 0: at the end only); drop it":
        _flags("save_strategy"),
    "twinkle-sft always saves safetensors; drop it": _flags("safe_serialization"),
    "twinkle-sft saves a checkpoint at the end of the step on SIGTERM anyway; drop it":
        _flags("enable_jit_checkpoint use_flash_ckpt"),
    "twinkle-sft writes checkpoint-N directories only (see twinkle-sft's last line for the newest); drop it":
        _flags("create_checkpoint_symlink"),
    "use --num_train_epochs or --max_steps; drop it": _flags("max_epochs"),
    "twinkle-sft resumes the trainer state as --resume_from_checkpoint finds it; drop it":
        _flags("restore_callback_states_from_checkpoint"),
    "twinkle-sft takes no trainer callbacks or plugins (the Python API's Trainer does); drop it (--external_plugins "
    "is how swift sft loads twinkle: twinkle-sft --swift-plugin-path)": _flags("callbacks external_plugins"),
    "not implemented by twinkle-sft's trainer; drop it": _flags("""
        tf32 torch_compile torch_compile_backend torch_compile_mode use_liger_kernel liger_kernel_config
        neftune_noise_alpha torch_empty_cache_steps auto_find_batch_size full_determinism
        gradient_checkpointing_kwargs use_logits_to_keep debug"""),
    "twinkle-sft stops at a bad flag; drop it": _flags("ignore_args_error"),
    "twinkle-sft reads a YAML recipe, not swift's args.json: pass it as the first argument, and drop it":
        _flags("load_args load_data_args"),
}

SWIFT_FLAGS_NOT_TAKEN: dict[str, str] = {flag: reason for reason, flags in _REASONS.items() for flag in flags}
