"""STAND-IN for an unmodified Megatron-LM ``pretrain_gpt.py`` (see ``megatron/training/__init__.py`` here).

It calls ``pretrain`` the way every ``pretrain_gpt.py`` does; nothing in it
mentions torchpass. ``--torchpass`` can only be accepted if ``torchpass
launch`` installed the adapter's hooks before the script ran.
"""

from megatron.training import pretrain

if __name__ == "__main__":
    pretrain(None, None, None, forward_step_func=None)
