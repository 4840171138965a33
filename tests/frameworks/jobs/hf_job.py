"""A tiny Hugging Face Trainer run on CPU, with no memtrack code: a 1-layer
GPT-2 built from a config, an in-memory dataset, evaluation and checkpoints.
argv: output_dir steps batch_size grad_accum"""
import sys

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

out, steps, batch, accum = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
torch.manual_seed(0)
config = GPT2Config(n_layer=1, n_head=2, n_embd=32, vocab_size=97, n_positions=16)
model = GPT2LMHeadModel(config)


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n):
        self.ids = torch.randint(0, 97, (n, 16))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


args = TrainingArguments(
    output_dir=out,
    max_steps=steps,
    per_device_train_batch_size=batch,
    per_device_eval_batch_size=batch,
    gradient_accumulation_steps=accum,
    eval_strategy="steps",
    eval_steps=10,
    save_strategy="steps",
    save_steps=10,
    logging_steps=10,
    report_to=[],
    use_cpu=True,
    dataloader_num_workers=0,
    disable_tqdm=True,
)
trainer = Trainer(model=model, args=args, train_dataset=Tokens(256), eval_dataset=Tokens(16))
trainer.train()
trainer.predict(Tokens(8))
print("job finished", trainer.state.global_step)
