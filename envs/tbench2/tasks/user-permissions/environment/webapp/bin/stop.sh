#!/bin/bash
pkill -f "http.server 8000"
