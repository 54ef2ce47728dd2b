#!/bin/bash
echo "ready"
