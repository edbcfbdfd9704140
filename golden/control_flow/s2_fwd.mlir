module @jit_s2_fwd attributes {mhlo.num_partitions = 2 : i32, mhlo.num_replicas = 1 : i32} {
  sdy.mesh @mesh = <["data"=2]> {stablehlo.mesh = {axes = [{name = "data", size = 2 : i64}]}}
  func.func public @main(%arg0: tensor<8x8xf32> {sdy.sharding = #sdy.sharding<@mesh, [{}, {}]>}, %arg1: tensor<4x8xf32> {sdy.sharding = #sdy.sharding<@mesh, [{}, {}]>}) -> (tensor<f32> {jax.result_info = "result[0]", sdy.sharding = #sdy.sharding<@mesh, []>}, tensor<8x8xf32> {jax.result_info = "result[1]", sdy.sharding = #sdy.sharding<@mesh, [{}, {}]>}, tensor<4x8xf32> {jax.result_info = "result[2]", sdy.sharding = #sdy.sharding<@mesh, [{}, {}]>}) {
    %cst = stablehlo.constant dense<0.000000e+00> : tensor<f32>
    %0 = stablehlo.broadcast_in_dim %cst, dims = [] : (tensor<f32>) -> tensor<3x4x8xf32>
    %cst_0 = stablehlo.constant dense<0.000000e+00> : tensor<f32>
    %1 = stablehlo.broadcast_in_dim %cst_0, dims = [] : (tensor<f32>) -> tensor<3x4x8xf32>
    %c = stablehlo.constant dense<0> : tensor<i32>
    %2:5 = stablehlo.while(%iterArg = %arg0, %iterArg_6 = %c, %iterArg_7 = %arg1, %iterArg_8 = %0, %iterArg_9 = %1) : tensor<8x8xf32>, tensor<i32>, tensor<4x8xf32>, tensor<3x4x8xf32>, tensor<3x4x8xf32>
    cond {
      %c_10 = stablehlo.constant dense<3> : tensor<i32>
      %11 = stablehlo.compare LT, %iterArg_6, %c_10, SIGNED : (tensor<i32>, tensor<i32>) -> tensor<i1>
      stablehlo.return %11 : tensor<i1>
    } do {
      %11:3 = func.call @closed_call(%iterArg, %iterArg_7) : (tensor<8x8xf32>, tensor<4x8xf32>) -> (tensor<4x8xf32>, tensor<4x8xf32>, tensor<4x8xf32>)
      %12 = func.call @dynamic_update_index_in_dim(%iterArg_8, %11#1, %iterArg_6) : (tensor<3x4x8xf32>, tensor<4x8xf32>, tensor<i32>) -> tensor<3x4x8xf32>
      %13 = func.call @dynamic_update_index_in_dim(%iterArg_9, %11#2, %iterArg_6) : (tensor<3x4x8xf32>, tensor<4x8xf32>, tensor<i32>) -> tensor<3x4x8xf32>
      %c_10 = stablehlo.constant dense<1> : tensor<i32>
      %14 = stablehlo.add %iterArg_6, %c_10 : tensor<i32>
      stablehlo.return %iterArg, %14, %11#0, %12, %13 : tensor<8x8xf32>, tensor<i32>, tensor<4x8xf32>, tensor<3x4x8xf32>, tensor<3x4x8xf32>
    }
    %3 = stablehlo.multiply %2#2, %2#2 : tensor<4x8xf32>
    %cst_1 = stablehlo.constant dense<2.000000e+00> : tensor<f32>
    %4 = stablehlo.broadcast_in_dim %cst_1, dims = [] : (tensor<f32>) -> tensor<4x8xf32>
    %5 = stablehlo.multiply %4, %2#2 : tensor<4x8xf32>
    %cst_2 = stablehlo.constant dense<0.000000e+00> : tensor<f32>
    %6 = stablehlo.reduce(%3 init: %cst_2) applies stablehlo.add across dimensions = [0, 1] : (tensor<4x8xf32>, tensor<f32>) -> tensor<f32>
    %cst_3 = stablehlo.constant dense<1.000000e+00> : tensor<f32>
    %7 = stablehlo.broadcast_in_dim %cst_3, dims = [] : (tensor<f32>) -> tensor<4x8xf32>
    %8 = stablehlo.multiply %7, %5 : tensor<4x8xf32>
    %cst_4 = stablehlo.constant dense<0.000000e+00> : tensor<f32>
    %9 = stablehlo.broadcast_in_dim %cst_4, dims = [] : (tensor<f32>) -> tensor<8x8xf32>
    %c_5 = stablehlo.constant dense<0> : tensor<i32>
    %10:6 = stablehlo.while(%iterArg = %2#3, %iterArg_6 = %2#4, %iterArg_7 = %arg0, %iterArg_8 = %c_5, %iterArg_9 = %9, %iterArg_10 = %8) : tensor<3x4x8xf32>, tensor<3x4x8xf32>, tensor<8x8xf32>, tensor<i32>, tensor<8x8xf32>, tensor<4x8xf32>
    cond {
      %c_11 = stablehlo.constant dense<3> : tensor<i32>
      %11 = stablehlo.compare LT, %iterArg_8, %c_11, SIGNED : (tensor<i32>, tensor<i32>) -> tensor<i1>
      stablehlo.return %11 : tensor<i1>
    } do {
      %c_11 = stablehlo.constant dense<3> : tensor<i32>
      %11 = stablehlo.subtract %c_11, %iterArg_8 : tensor<i32>
      %c_12 = stablehlo.constant dense<1> : tensor<i32>
      %12 = stablehlo.subtract %11, %c_12 : tensor<i32>
      %13 = func.call @dynamic_index_in_dim(%iterArg, %12) : (tensor<3x4x8xf32>, tensor<i32>) -> tensor<4x8xf32>
      %14 = func.call @dynamic_index_in_dim(%iterArg_6, %12) : (tensor<3x4x8xf32>, tensor<i32>) -> tensor<4x8xf32>
      %15:2 = func.call @closed_call_0(%iterArg_7, %iterArg_9, %iterArg_10, %13, %14) : (tensor<8x8xf32>, tensor<8x8xf32>, tensor<4x8xf32>, tensor<4x8xf32>, tensor<4x8xf32>) -> (tensor<8x8xf32>, tensor<4x8xf32>)
      %c_13 = stablehlo.constant dense<1> : tensor<i32>
      %16 = stablehlo.add %iterArg_8, %c_13 : tensor<i32>
      stablehlo.return %iterArg, %iterArg_6, %iterArg_7, %16, %15#0, %15#1 : tensor<3x4x8xf32>, tensor<3x4x8xf32>, tensor<8x8xf32>, tensor<i32>, tensor<8x8xf32>, tensor<4x8xf32>
    }
    return %6, %10#4, %10#5 : tensor<f32>, tensor<8x8xf32>, tensor<4x8xf32>
  }
  func.func private @closed_call(%arg0: tensor<8x8xf32>, %arg1: tensor<4x8xf32>) -> (tensor<4x8xf32>, tensor<4x8xf32>, tensor<4x8xf32>) {
    %0 = stablehlo.dot_general %arg1, %arg0, contracting_dims = [1] x [0], precision = [DEFAULT, DEFAULT] : (tensor<4x8xf32>, tensor<8x8xf32>) -> tensor<4x8xf32>
    %1 = stablehlo.sine %0 : tensor<4x8xf32>
    %2 = stablehlo.cosine %0 : tensor<4x8xf32>
    return %1, %arg1, %2 : tensor<4x8xf32>, tensor<4x8xf32>, tensor<4x8xf32>
  }
  func.func private @dynamic_update_index_in_dim(%arg0: tensor<3x4x8xf32>, %arg1: tensor<4x8xf32>, %arg2: tensor<i32>) -> tensor<3x4x8xf32> {
    %0 = stablehlo.broadcast_in_dim %arg1, dims = [1, 2] : (tensor<4x8xf32>) -> tensor<1x4x8xf32>
    %c = stablehlo.constant dense<0> : tensor<i32>
    %c_0 = stablehlo.constant dense<0> : tensor<i32>
    %1 = stablehlo.dynamic_update_slice %arg0, %0, %arg2, %c, %c_0 : (tensor<3x4x8xf32>, tensor<1x4x8xf32>, tensor<i32>, tensor<i32>, tensor<i32>) -> tensor<3x4x8xf32>
    return %1 : tensor<3x4x8xf32>
  }
  func.func private @dynamic_index_in_dim(%arg0: tensor<3x4x8xf32>, %arg1: tensor<i32>) -> tensor<4x8xf32> {
    %c = stablehlo.constant dense<0> : tensor<i32>
    %c_0 = stablehlo.constant dense<0> : tensor<i32>
    %0 = stablehlo.dynamic_slice %arg0, %arg1, %c, %c_0, sizes = [1, 4, 8] : (tensor<3x4x8xf32>, tensor<i32>, tensor<i32>, tensor<i32>) -> tensor<1x4x8xf32>
    %1 = stablehlo.reshape %0 : (tensor<1x4x8xf32>) -> tensor<4x8xf32>
    return %1 : tensor<4x8xf32>
  }
  func.func private @closed_call_0(%arg0: tensor<8x8xf32>, %arg1: tensor<8x8xf32>, %arg2: tensor<4x8xf32>, %arg3: tensor<4x8xf32>, %arg4: tensor<4x8xf32>) -> (tensor<8x8xf32>, tensor<4x8xf32>) {
    %0 = stablehlo.multiply %arg2, %arg4 : tensor<4x8xf32>
    %1 = stablehlo.dot_general %0, %arg3, contracting_dims = [0] x [0], precision = [DEFAULT, DEFAULT] : (tensor<4x8xf32>, tensor<4x8xf32>) -> tensor<8x8xf32>
    %2 = stablehlo.transpose %1, dims = [1, 0] : (tensor<8x8xf32>) -> tensor<8x8xf32>
    %3 = stablehlo.add %arg1, %2 : tensor<8x8xf32>
    %4 = stablehlo.dot_general %0, %arg0, contracting_dims = [1] x [1], precision = [DEFAULT, DEFAULT] : (tensor<4x8xf32>, tensor<8x8xf32>) -> tensor<4x8xf32>
    return %3, %4 : tensor<8x8xf32>, tensor<4x8xf32>
  }
}
