"""STAND-IN (see ``__init__``): core_v0.16.1's ``pretrain`` -> ``train`` -> ``train_step`` call path.

``pretrain`` calls ``initialize_megatron`` (bound by name, training.py:136) and
``train``, which calls ``train_step`` through the module global once per
iteration (training.py:2795). The bodies do no training.
"""

from megatron.training.initialize import initialize_megatron

from .global_vars import get_args


def train_step(
    forward_step_func,
    data_iterator,
    model,
    optimizer,
    opt_param_scheduler,
    config,
    forward_backward_func,
    iteration=None,
):
    return {}, 0, False, False, 0, None, None, 0


def train(forward_step_func, model, optimizer, opt_param_scheduler, train_data_iterator, config):
    args = get_args()
    iteration = 0
    while iteration < (args.train_iters or 0):
        train_step(forward_step_func, train_data_iterator, model, optimizer, opt_param_scheduler, config, None, iteration=iteration)
        iteration += 1
    return iteration


def pretrain(
    train_valid_test_dataset_provider,
    model_provider,
    model_type,
    forward_step_func,
    process_non_loss_data_func=None,
    extra_args_provider=None,
    args_defaults={},
    get_embedding_ranks=None,
    get_position_embedding_ranks=None,
    non_loss_data_func=None,
    store=None,
    inprocess_call_wrapper=None,
):
    initialize_megatron(extra_args_provider=extra_args_provider, args_defaults=args_defaults, store=store)
    return train(forward_step_func, None, None, None, None, None)
