"""`python -m hsbn`: says which native parts this hsbn uses and what they support.
`python -m hsbn status ...` is `hsbn status ...` (hsbn/cli.py)."""

import sys

from . import _lib, __version__


def main():
    print("hsbn %s (%s)" % (__version__, __file__.rsplit("/", 1)[0]))
    ok = True
    try:
        lib = _lib.lib()
        print("libhsbn.so       %s (C ABI %d)" % (lib.hsbn_path, lib.hsbn_abi_version()))
        k = _lib.bn_kernels()
        if k is None:
            print("BN kernels       not in the library (torch's ops are used)")
        else:
            print("BN kernels       CPU%s" % (" and CUDA" if k.hsbn_bn_cuda_available()
                                              else "; CUDA not built or no GPU visible"))
    except _lib.NativeNotFoundError as e:
        print("libhsbn.so       MISSING: %s" % e)
        ok = False
    try:
        print("hsbn-aggregator  %s" % _lib.aggregator_path())
    except _lib.NativeNotFoundError as e:
        print("hsbn-aggregator  MISSING: %s" % e)
        ok = False
    try:
        import torch
        print("torch            %s (CUDA %s)" % (torch.__version__, torch.cuda.is_available()))
        from .torch import _ops
        try:
            for kind, (which, why) in (("CPU ", _ops.cpu_ops_choice()),
                                       ("CUDA", _ops.cuda_ops_choice())):
                name = "hsbn's kernels" if which == "kernels" else "torch's ops"
                print("%s BN ops      %s (%s: %s)" % (kind, which, name, why))
        except ValueError as e:
            print("BN ops           INVALID: %s" % e)
            ok = False
    except ImportError:
        print("torch            not installed (hsbn.torch needs it)")
    return 0 if ok else 1


if __name__ == "__main__":
    from .cli import main as cli_main  # `hsbn`: no arguments run main() above
    sys.exit(cli_main())
