"""DeepSpeed's getting-started training loop on a transformers Llama; the one change from DeepSpeed's
tutorial is `import megazero as deepspeed` (docs/own_model.md). Run on 2 ranks:
    torchrun --nproc-per-node 2 examples/deepspeed_loop.py --deepspeed_config examples/ds_config.json
"""

import argparse
import torch
import transformers
import megazero as deepspeed

parser = deepspeed.add_config_arguments(argparse.ArgumentParser(description="a Llama, DeepSpeed's way"))
cmd_args = parser.parse_args()
net = transformers.LlamaForCausalLM(
    transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4
    )
)
trainset = (torch.randint(0, 256, (128, 1), generator=torch.Generator().manual_seed(0)) + torch.arange(32)) % 256
model_engine, optimizer, trainloader, __ = deepspeed.initialize(
    args=cmd_args, model=net, model_parameters=net.parameters(), training_data=trainset
)
for step, tokens in enumerate(trainloader):
    loss = model_engine(input_ids=tokens, labels=tokens).loss
    model_engine.backward(loss)
    model_engine.step()
    if step % 4 == 3 and model_engine.global_rank == 0:
        print(f"step {model_engine.global_steps} loss {loss.item():.4f} lr {model_engine.get_lr()[0]:.2e}")
