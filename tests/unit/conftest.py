"""Fixtures shared by the HTTP API tests: an app around a scripted engine.

A module provides the ``engine`` fixture (what the scripted model says); these
build the service, the app and an in-process client around it.
"""

from __future__ import annotations

from pathlib import Path
from typing import AsyncIterator

import httpx
import pytest
from fastapi import FastAPI

from engine.api.service import EngineService
from tests.support.router_app import build_app, make_service
from tests.support.scripted_engine import ScriptedEngine


@pytest.fixture
def service(tmp_path: Path, engine: ScriptedEngine) -> EngineService:
    return make_service(tmp_path, engine)


@pytest.fixture
def app(service: EngineService) -> FastAPI:
    return build_app(service)


@pytest.fixture
async def client(app: FastAPI) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://test") as http:
        yield http
