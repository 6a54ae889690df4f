"""Several models in one script (a GAN) are told apart by their variable names."""

from __future__ import annotations

import textwrap


def test_two_models_are_named_by_their_variables(run_cli, tmp_path):
    script = tmp_path / "gan.py"
    script.write_text(textwrap.dedent("""
        import torch
        from torch import nn

        def main():
            generator = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 4))
            discriminator = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
            g_opt = torch.optim.SGD(generator.parameters(), lr=0.01)
            d_opt = torch.optim.SGD(discriminator.parameters(), lr=0.01)
            for step in range(3):
                fake = generator(torch.randn(8, 4))
                d_loss = discriminator(fake.detach()).mean()
                d_opt.zero_grad()
                d_loss.backward()
                d_opt.step()
                if step == 2:
                    with torch.no_grad():
                        discriminator[2].weight.fill_(float("nan"))
                g_loss = -discriminator(fake).mean()
                g_opt.zero_grad()
                g_loss.backward()
                g_opt.step()

        if __name__ == "__main__":
            main()
    """))
    res = run_cli("diagnose", "--quiet", str(script))
    assert res.code == 1, res.stderr
    modules = {layer["module"] for layer in res.report["layers"]}
    assert {"0", "2", "discriminator.0", "discriminator.2"} <= modules
    f = res.report["first_failure"]
    assert f["module"] == "discriminator.2"
    assert f["phase"] == "optimizer" or f["tensor"] == "output"
