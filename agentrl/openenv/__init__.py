"""OpenEnv interop: agentrl's environments served as OpenEnv environment servers (`server`,
`terminal`, `guard`, `schema`), and OpenEnv servers driven as agentrl environments (`client`; the
plugin is `envs/openenv`). Needs the `openenv` package (the slim install: `docs/openenv.md`); this
package imports nothing of it until used.
"""
