"""How eval.py's examples become batches: padded on the right with their attention masks; grouped by length, in
order for evaluation, shuffled for training. A reader of the lessons may skip this file."""
import numpy as np
import torch


def pad_batch(seqs, pad_value, device):
    """list of id lists -> (B, T) long tensor padded on the right, and its (B, T) attention mask."""
    T = max(len(s) for s in seqs)
    ids = torch.tensor([s + [pad_value] * (T - len(s)) for s in seqs], device=device)
    mask = torch.tensor([[1] * len(s) + [0] * (T - len(s)) for s in seqs], device=device)
    return ids, mask


def batches_by_length(seqs, batch_size):
    """Index arrays of batch_size sequences of similar length (evaluation: order is free there)."""
    order = np.argsort([len(s) for s in seqs], kind="stable")
    return [order[i:i + batch_size] for i in range(0, len(order), batch_size)]


def length_grouped(lengths, batch_size, generator, group=64):
    """One epoch's batches: the examples in a random order, cut into runs of `group` batches, each
    run sorted by length and cut into batches, the batches shuffled. Little padding (a batch pads to
    its longest example), a random order of batches. Hugging Face's group_by_length sorts such runs
    too but keeps their batches in order, longest first (an out-of-memory error comes early there)."""
    order = torch.randperm(len(lengths), generator=generator).tolist()
    batches = []
    for i in range(0, len(order), group * batch_size):
        run = sorted(order[i:i + group * batch_size], key=lambda j: lengths[j])
        batches += [run[k:k + batch_size] for k in range(0, len(run), batch_size)]
    return [batches[i] for i in torch.randperm(len(batches), generator=generator).tolist()]
